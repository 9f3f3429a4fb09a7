"""Step arithmetic of a run: one optimizer step's micro-batches, sequences and tokens over the
data-parallel processes (`Steps`), and the LR schedule (below the methods, which reshape both)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.config import TrainConfig
from harness.errors import UserError


@dataclass(frozen=True)
class Steps:
    """One optimizer step of a run on `world` data-parallel processes. Built once (`Steps.of`)
    and handed to the trainer, the method and the estimator, so that a run and its estimate
    count the same micro-batches: `total_batch_size` is the global batch, and each process
    accumulates its share of it."""

    world: int  # data-parallel processes
    micro_batch: int  # sequences per forward on one process (train.batch_size)
    accumulation: int  # micro-batches per step on one process
    seq_len: int  # tokens per sequence (GLUE: at most this)
    # processes a weight is split over: 1 (one process, ddp), world (fsdp), the group (hsdp)
    shards: int = 1

    @classmethod
    def of(cls, train: TrainConfig, seq_len: int, world: int = 1,
           world_from: str = "WORLD_SIZE", local: int | None = None) -> Steps:
        """The arithmetic of `train` over `world` processes, `local` of them a node's (default:
        all); refuses a global batch that does not split into whole micro-batches on every
        process, or an hsdp shard group that does not divide the processes (`world_from`:
        where the error says the process count came from)."""
        total, micro = train.total_batch_size or train.batch_size, train.batch_size
        if total % (micro * world):
            raise UserError(
                f"train.total_batch_size: {total} sequences per step do not split into whole "
                f"micro-batches of batch_size {micro} over {world} processes "
                f"({world_from}); use a multiple of {micro * world}"
            )
        return cls(world, micro, total // (micro * world), seq_len,
                   shards_of(train, world, world_from, local))

    @property
    def global_accumulation(self) -> int:
        """Micro-batches per step over all processes (`TrainConfig.accumulation`)."""
        return self.accumulation * self.world

    @property
    def sequences(self) -> int:
        """Sequences per optimizer step, over all processes (`total_batch_size`)."""
        return self.micro_batch * self.global_accumulation

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step, over all processes (GLUE: at most this many)."""
        return self.sequences * self.seq_len


def shards_of(train: TrainConfig, world: int, world_from: str = "WORLD_SIZE",
              local: int | None = None) -> int:
    """The processes each weight is split over: hsdp's shard group (`train.shard_group`, else
    the `local` processes of a node) must divide `world`, the groups replicating each other."""
    if world == 1 or not train.sharded:
        return 1
    if train.parallel == "fsdp":
        return world
    group = train.shard_group or local or world
    if world % group:
        allowed = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        said = (f"{group}" if train.shard_group else
                f"unset, so a node's {group} processes (LOCAL_WORLD_SIZE),")
        raise UserError(f"train.shard_group: {said} does not divide the {world} processes "
                        f"({world_from}) into whole groups; allowed: {allowed}")
    return group


def lr_factor(step: int, t: TrainConfig) -> float:
    """Linear warmup, then cosine (or linear) decay to `min_lr_ratio`, constant, or wsd's
    stable phase and decay; `step` counts from 0."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    if t.schedule == "wsd":
        return wsd_factor(step, t)
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay


def wsd_factor(step: int, t: TrainConfig) -> float:
    """Warmup-stable-decay after the warmup: 1 until the last `decay_fraction` of the steps
    (rounded half up, at least one, never into the warmup), then linear to `min_lr_ratio`,
    reached at step `steps` as cosine's is."""
    decay = max(1, int(t.decay_fraction * t.steps + 0.5))
    start = max(t.warmup_steps, t.steps - decay)
    progress = min(1.0, max(0, step - start) / max(1, t.steps - start))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 - progress)
