"""A trainer's checkpoint: what it saves (model, optimizer, schedule, data position, RNG,
precision and counters) and how a resume puts it back (harness/trials/checkpoints.py writes and
verifies the files)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from harness import distributed
from harness.distributed import fsdp
from harness.trials import Records, checkpoints, rng_state, set_rng_state


class Trained(Protocol):
    """The parts of a trainer a checkpoint holds (harness/train/loop.py `Trainer`)."""

    rec: Records
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: Any
    precision: Any
    sharded: bool
    step: int
    tokens: int
    last_eval: dict[str, float]
    best: dict[str, float]
    costs: dict[str, Any]
    grad_norms: list[float]


def save(t: Trained) -> None:
    """Rank 0 writes the bare model's state; under fsdp every rank writes its own shards
    and rank 0 the rest (torch.distributed.checkpoint), which a resume reads at any number
    of processes."""
    if not t.sharded:  # fsdp ranks hold different rows by design
        distributed.check_same(t.model, t.step)
    tensors = {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict()}
    if t.sharded:
        skeleton, flat = fsdp.split(tensors)
        t.rec.save_sharded_checkpoint(flat, {"tensors": skeleton, **rest(t)})
    else:
        t.rec.save_checkpoint({**tensors, **rest(t)})


def rest(t: Trained) -> dict[str, Any]:
    """A checkpoint's state beside the model's and the optimizer's."""
    return {
        "scheduler": t.scheduler.state_dict(),
        "data": t.data.state(),
        "rng": rng_state(),
        "step": t.step,
        "tokens": t.tokens,
        "last_eval": t.last_eval,
        "best": t.best,
        "costs": t.costs,
        "grad_norms": t.grad_norms,
        "precision": t.precision.state_dict(),
    }


def resume(t: Trained) -> bool:
    """Model, optimizer, schedule, data, RNG, precision and counters from the last checkpoint
    into `t`; False where there is none (then no metrics lines kept)."""
    state = t.rec.load_checkpoint()
    if state is None:
        t.rec.truncate_metrics(0)  # a start from scratch owns no earlier lines
        return False
    load_tensors(t, state)
    t.scheduler.load_state_dict(state["scheduler"])
    t.data.restore(state["data"])
    set_rng_state(state["rng"])
    t.step, t.tokens = state["step"], state["tokens"]
    t.last_eval, t.costs, t.best = state["last_eval"], state["costs"], state["best"]
    t.grad_norms = state.get("grad_norms", t.grad_norms)  # older checkpoints: none
    t.precision.load_state_dict(state["precision"])
    t.rec.truncate_metrics(t.step)
    t.rec.set_aside_skipped()  # newer ones that did not load: one line each
    distributed.say(f"resumed from {t.rec.loaded} at step {t.step}")
    return True


def load_tensors(t: Trained, state: dict[str, Any]) -> None:
    """The model's and optimizer's tensors, as this world size holds them."""
    if "sharded" in state:  # written shard by shard: read as this world size holds it
        tensors = fsdp.templates(state["tensors"], t.model)
        state.update(fsdp.join(state.pop("tensors"),
                               checkpoints.load_sharded(state["sharded"], tensors)))
        t.model.load_state_dict(state["model"])
    elif t.sharded:  # a whole model (one process's checkpoint): each rank keeps its rows
        fsdp.load_whole(t.model, state["model"])
    else:
        t.model.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    if t.sharded:
        fsdp.shard_states(t.optimizer.state)
