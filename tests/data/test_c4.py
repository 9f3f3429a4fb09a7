"""Packing, padding, deterministic order, exact stream state, local shards, missing data."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import SAMPLE_VOCAB, write_c4_shards

from harness.config import TaskConfig
from harness.data.c4 import BlockStream, Packer, eval_blocks, load_tokenizer, open_documents
from harness.data.loader import IGNORE, to_batch
from harness.errors import UserError

FAKE_TOKENIZER = SimpleNamespace(eos_token_id=1, pad_token_id=0)


def feeder(*docs: list[int]):
    it = iter(np.asarray(d, dtype=np.int32) for d in docs)
    return lambda: next(it)


def test_packing_puts_eos_between_documents_and_carries_the_rest():
    packer = Packer(TaskConfig(seq_len=4), FAKE_TOKENIZER)
    next_doc = feeder([2, 3, 4], [5, 6], [7, 8, 9, 10])
    blocks = [packer.block(next_doc) for _ in range(3)]
    assert [b.tolist() for b, _ in blocks] == [[2, 3, 4, 1], [5, 6, 1, 7], [8, 9, 10, 1]]
    assert [n for _, n in blocks] == [4, 4, 4]


def test_truncate_and_pad_masks_padding_out_of_the_loss():
    packer = Packer(TaskConfig(seq_len=4, packing=False), FAKE_TOKENIZER)
    next_doc = feeder([2, 3, 4, 5, 6], [7, 8])
    blocks = [packer.block(next_doc) for _ in range(2)]
    assert [(b.tolist(), n) for b, n in blocks] == [([2, 3, 4, 5], 4), ([7, 8, 1, 0], 3)]
    ids, labels = to_batch(blocks, pin=False)
    assert labels.tolist() == [[2, 3, 4, 5], [7, 8, 1, IGNORE]]
    assert ids.dtype == labels.dtype == ids.new_zeros(0, dtype=int).dtype


def take(stream: BlockStream, n: int) -> list[list[int]]:
    return [stream.next_block()[0].tolist() for _ in range(n)]


def test_order_is_deterministic_from_the_seed_and_resumes_exactly(sample_tokenizer):
    tok = sample_tokenizer
    task = TaskConfig(seq_len=64, shuffle_buffer=16)
    a = BlockStream(task, tok, seed=0)
    head = take(a, 30)
    state = a.state()
    tail = take(a, 30)
    assert head == take(BlockStream(task, tok, seed=0), 30)
    assert head != take(BlockStream(task, tok, seed=1), 30)
    resumed = BlockStream(task, tok, seed=0)
    resumed.restore(state)
    assert take(resumed, 30) == tail


class CountingTokenizer:
    """The sample tokenizer, counting the documents it is asked to tokenize."""

    def __init__(self, tok) -> None:
        self.tok, self.documents = tok, 0
        self.eos_token_id, self.pad_token_id = tok.eos_token_id, tok.pad_token_id

    def __call__(self, text, **kwargs):
        self.documents += 1 if isinstance(text, str) else len(text)
        return self.tok(text, **kwargs)


def test_a_full_shuffle_buffer_tokenizes_only_the_documents_drawn(sample_tokenizer):
    """1000 documents held (the default; the whole 963-document sample), yet the first block
    tokenizes only what it packs: a trial's first step does not wait for the whole buffer."""
    tok = CountingTokenizer(sample_tokenizer)
    stream = BlockStream(TaskConfig(seq_len=64, shuffle_buffer=1000), tok, seed=0)
    stream.next_block()
    assert len(stream.buffer) > 900 and 1 <= tok.documents <= 3


def test_a_buffer_of_token_arrays_from_an_older_checkpoint_resumes_the_same_blocks(
        sample_tokenizer):
    """Checkpoints written before the buffer held texts hold token arrays: restored, the stream
    goes on with exactly the blocks a text buffer gives."""
    tok = sample_tokenizer
    task = TaskConfig(seq_len=64, shuffle_buffer=16)
    stream = BlockStream(task, tok, seed=0)
    take(stream, 5)
    state = stream.state()
    tail = take(stream, 40)
    state["buffer"] = [np.asarray(tok(t, add_special_tokens=False)["input_ids"], np.int32)
                       for t in state["buffer"]]
    old = BlockStream(task, tok, seed=0)
    old.restore(state)
    assert take(old, 40) == tail


def test_small_corpus_wraps_into_a_new_epoch(tmp_path, sample_tokenizer):
    tok = sample_tokenizer
    write_c4_shards(tmp_path, {"train": ["one two three four five"] * 3, "validation": ["six"]})
    stream = BlockStream(TaskConfig(dataset=str(tmp_path), seq_len=8, shuffle_buffer=2), tok, 0)
    take(stream, 10)
    assert stream.epoch >= 1


def test_local_c4_shards_by_folder_and_by_glob(tiny_corpus):
    assert len(list(tiny_corpus.glob("c4-train.*-of-00002.json.gz"))) == 2
    by_dir = [r["text"] for r in open_documents(TaskConfig(dataset=str(tiny_corpus)), "train")]
    assert sorted(by_dir) == sorted(f"train doc {i}" for i in range(6))
    glob_task = TaskConfig(dataset=str(tiny_corpus / "c4-train.*.json.gz"))
    assert len(list(open_documents(glob_task, "train"))) == 6
    assert [r["text"] for r in open_documents(glob_task, "validation")] == ["valid doc"]


def test_missing_data_and_tokenizer_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"task.dataset: no train shards match '.*c4-train"):
        open_documents(TaskConfig(dataset=str(tmp_path)), "train")
    with pytest.raises(UserError, match=r"task.tokenizer: no folder './missing'"):
        load_tokenizer("./missing")
    start = time.time()
    with pytest.raises(UserError, match=r"task.tokenizer: 't5-base' is not in the local Hugging "
                       r"Face cache and the hub cannot be reached \(offline: "):
        load_tokenizer("t5-base")  # offline here: one clear line, at once
    with pytest.raises(UserError, match=r"task.dataset: 'c4' streams allenai/c4 from the Hugging "
                       r"Face hub, which cannot be reached \(offline: "):
        open_documents(TaskConfig(dataset="c4"), "train")
    assert time.time() - start < 10  # no retries: under a second each, measured


def test_eval_takes_a_fixed_number_of_tokens_in_file_order(sample_tokenizer):
    tok = sample_tokenizer
    task = TaskConfig(seq_len=64)
    blocks = eval_blocks(task, tok, 1000)
    assert sum(n - 1 for _, n in blocks) >= 1000 > sum(n - 1 for _, n in blocks[:-1])
    again = eval_blocks(task, tok, 1000)
    assert all((a == b).all() for (a, _), (b, _) in zip(blocks, again, strict=True))


def test_sample_tokenizer_fixture_is_the_loaded_sample(sample_tokenizer):
    """The shared fixture and SAMPLE_VOCAB (which tests size models by) are the real thing."""
    assert len(sample_tokenizer) == SAMPLE_VOCAB
    assert sample_tokenizer.name_or_path == load_tokenizer("sample").name_or_path
    assert sample_tokenizer.eos_token_id is not None
