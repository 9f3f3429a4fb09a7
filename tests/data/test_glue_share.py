"""GLUE fine-tuning data parallel (harness/train/finetune.py's GlueData): a rank tokenizes only
the training examples of the micro-batches it takes, which are one process's, every W-th."""

from __future__ import annotations

import torch
from conftest import micro_run

from harness.config.steps import Steps
from harness.methods.resolve import load_run
from harness.train.finetune import GlueData

CPU = torch.device("cpu")


class Counting:
    """The tokenizer, counting the examples it is asked for (a batch call: one list a column)."""

    def __init__(self, tok):
        self.tok, self.examples = tok, 0

    def __call__(self, first, *rest, **kwargs):
        self.examples += len(first)
        return self.tok(first, *rest, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_rank_tokenizes_only_the_examples_it_takes(monkeypatch, sample_tokenizer):
    data = micro_run(batch_size=8, total_batch_size=16)
    data["task"] = {"kind": "glue", "glue_task": "sample", "tokenizer": "sample", "seq_len": 48}
    run = load_run(data)
    one = GlueData(run, sample_tokenizer, CPU, Steps.of(run.train, 48))
    whole = [one.next()[0] for _ in range(4)]  # micro-batches 0 to 3 of one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    tok = Counting(sample_tokenizer)
    rank1 = GlueData(run, tok, CPU, Steps.of(run.train, 48, world=2))
    assert tok.examples == 400  # the validation split, which every rank scores whole
    for want in (whole[1], whole[3]):  # rank 1 of 2 takes micro-batches 1 and 3
        got = rank1.next()[0]
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert tok.examples == 400 + 2 * 8  # not the training split's 2,000
