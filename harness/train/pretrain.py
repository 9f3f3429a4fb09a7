"""Pretraining as the loop sees it: a LLaMA preset or a Hugging Face decoder (harness/models.py),
packed blocks of text, next-token loss, and validation perplexity over a fixed set of held-out
tokens."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from harness import distributed
from harness.config import RunConfig
from harness.config.steps import Steps
from harness.data.c4 import BlockStream, eval_blocks, load_tokenizer
from harness.data.loader import IGNORE, Prefetcher, to_batch
from harness.data.split import SplitTokenizer
from harness.distributed.host import host_group
from harness.modifiers.kernels import use_kernels
from harness.modifiers.precision import Precision
from harness.train import lm_loss
from harness.train.build import build_model

Batch = tuple[torch.Tensor, torch.Tensor]  # token ids, labels (IGNORE where padded)


def build(run: RunConfig, skeleton: bool = False) -> tuple[nn.Module, Any]:
    """The model as model_options build it (MLP width, kernels), and the tokenizer. `skeleton`:
    a model with weights built from its config on the meta device, drawing nothing (as
    from_pretrained draws nothing), in eval mode (as from_pretrained leaves it), to be filled."""
    tok = load_tokenizer(run.task.tokenizer)
    with torch.device("meta") if skeleton else nullcontext():
        built = build_model(run.model, len(tok), run.task.seq_len, tok.pad_token_id,
                            run.model_options, weights=not skeleton)
    return use_kernels(built.eval() if skeleton else built, run), tok


def loss_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
             loss: lm_loss.HeadLoss = lm_loss.cross_entropy_sum,
             from_hidden: bool = False) -> torch.Tensor:
    """Summed next-token loss over real targets: token-weighted means need sums, not means.
    `loss` and `from_hidden` as lm_loss.head_loss gives them (train.loss_chunk, kernels)."""
    return lm_loss.next_token_loss(model, ids, labels, loss, from_hidden)


class LMData:
    """The seeded block stream, read ahead by a thread once training starts (after a resume
    has restored its position); data parallel, each rank tokenizes a share of the documents,
    the ranks exchange token ids over a gloo group of the thread's own, and each takes its
    share of every round (harness/data/split.py)."""

    steps_per_epoch = None

    def __init__(self, run: RunConfig, tok: Any, device: torch.device, steps: Steps) -> None:
        self.run, self.tok, self.device, self.steps = run, tok, device, steps
        rank = distributed.rank()  # each tokenizer's group: its thread's own (prefetch, main)
        self.stream = BlockStream(run.task, tok, run.seed,
                                  SplitTokenizer(tok, rank, steps.world, host_group()))
        self._split_eval = SplitTokenizer(tok, rank, steps.world, host_group())
        self.prefetch: Prefetcher | None = None
        self._eval: list[tuple[np.ndarray, int]] | None = None
        # after the model's last hidden state; `train.compile` compiles it in place
        self.head_loss, self.from_hidden = lm_loss.head_loss(run.train.loss_chunk,
                                                             run.model_options.kernels)

    def next(self) -> tuple[Batch, int]:
        if self.prefetch is None:
            self.prefetch = Prefetcher(self.stream, self.steps.micro_batch, self.device,
                                       rank=distributed.rank(), world=self.steps.world)
        ids, labels = self.prefetch.next()
        return (ids, labels), ids.numel()

    def count(self, batch: Batch) -> torch.Tensor:
        return (batch[1][:, 1:] != IGNORE).sum()

    def loss(self, net: nn.Module, batch: Batch) -> torch.Tensor:
        return loss_sum(net, *batch, self.head_loss, self.from_hidden)

    def state(self) -> Any:
        return self.prefetch.state() if self.prefetch else self.stream.state()

    def restore(self, state: Any) -> None:
        self.stream.restore(state)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, precision: Precision,
                 lockstep: bool = False) -> dict[str, float]:
        """Validation loss over the fixed held-out blocks, each rank every W-th batch.
        `lockstep` (fsdp, whose forward gathers weights with every rank): all ranks run as many
        forwards, a rank out of batches repeating the first without counting it."""
        run, world = self.run, self.steps.world
        if self._eval is None:
            self._eval = eval_blocks(run.task, self.tok, run.eval.tokens, self._split_eval)
            held = sum(n - 1 for _, n in self._eval)
            if held < run.eval.tokens:
                distributed.say(f"eval: the validation split holds {held:,} tokens, fewer "
                                f"than eval.tokens {run.eval.tokens:,}; using them all")
        batch = run.eval.batch_size or run.train.batch_size
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        starts = range(0, len(self._eval), batch)
        mine = starts[distributed.rank() :: world]  # data parallel: every W-th batch each
        rounds = -(-len(starts) // world) if lockstep else len(mine)
        for j in range(rounds):
            i = mine[j] if j < len(mine) else 0
            ids, labels = to_batch(self._eval[i : i + batch], pin=False)
            ids, labels = ids.to(self.device), labels.to(self.device)
            with precision.autocast():
                loss = loss_sum(model, ids, labels, self.head_loss, self.from_hidden).double()
            if j < len(mine):
                total += loss
                count += int((labels[:, 1:] != IGNORE).sum())
        if world > 1:  # float64 sums: the same loss as one process, to rounding
            sums = distributed.all_sum(torch.stack([total, total.new_tensor(count)]))
            total, count = sums[0], int(sums[1])
        loss = float(total) / count
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700)), "eval_tokens": count}

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
