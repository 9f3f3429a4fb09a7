"""A trainer's checkpoint: what it saves (model, optimizer, schedule, data position, RNG,
precision and counters) and how a resume puts it back (harness/trials/checkpoints.py writes and
verifies the files)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist_
from torch import nn

from harness import distributed
from harness.config import RunConfig
from harness.distributed import fsdp
from harness.errors import brief
from harness.methods.muon import Chain
from harness.modifiers.layerwise import LayerwiseOptimizer
from harness.train.averaged import averaged, training
from harness.trials import CheckpointError, Records, rng_state, set_rng_state, sharded


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


def save(t: Trained, background: sharded.Background | None = None) -> None:
    """Rank 0 writes the bare model's state; under fsdp every rank writes its own shards
    (torch.distributed.checkpoint, keyed by parameter name) and rank 0 the rest, which a resume
    reads at any number of processes; in the background with `background` (its tensors
    staged before `save_sharded_checkpoint` returns). The weights saved are the optimizer's
    averaged ones where it keeps them apart (Schedule-Free's x: harness/train/averaged.py), so
    that the exported model is too."""
    with averaged(t.optimizer, t.model):
        _save(t, background)


def _save(t: Trained, background: sharded.Background | None) -> None:
    if not t.sharded:  # fsdp ranks hold different rows by design
        distributed.check_same(t.model, t.step)
        t.rec.save_checkpoint({"model": t.model.state_dict(),
                               "optimizer": t.optimizer.state_dict(), **rest(t)})
        return
    model, optimizer = fsdp.state_dicts(t.model, optimizers(t.optimizer))
    extras, rngs = gathered([extra(o) for o in optimizers(t.optimizer)]), gathered(rng_state())
    t.rec.save_sharded_checkpoint({"model": model, "optimizer": optimizer},
                                  {**rest(t), "rngs": rngs, "extras": extras}, background)


def optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers torch's state-dict helpers see: a wrapper's inner ones (layer-wise, or
    Muon's chain), each of which keys its states by parameter."""
    if isinstance(optimizer, LayerwiseOptimizer):
        return [o for i in optimizer.inner.values() for o in optimizers(i)]
    if isinstance(optimizer, Chain):
        return [o for i in optimizer.inner for o in optimizers(i)]
    return [optimizer]


def extra(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What an optimizer's state dict holds beside states and groups (GaLore's SVD counts),
    which torch's helpers leave out: kept per rank in the rest."""
    return {k: v for k, v in optimizer.state_dict().items() if k not in ("state", "param_groups")}


def gathered(value: Any) -> list[Any]:
    """`value` of every rank, in rank order."""
    every: list[Any] = [None] * distributed.world_size()
    dist_.all_gather_object(every, value)
    return every


def background(run: RunConfig, is_sharded: bool) -> sharded.Background | None:
    """`train.checkpoint_async` under fsdp: saves written beside training."""
    return sharded.Background() if run.train.checkpoint_async and is_sharded else None


def close(background: sharded.Background | None) -> None:
    """The save in flight published; where it cannot be (a rank gone), one line: the
    checkpoint before it stays the newest."""
    if background is None:
        return
    try:
        background.close()
    except (Exception, CheckpointError) as e:
        print(f"warning: the checkpoint being written in the background is not published "
              f"({brief(e)}); the one before it is the newest", file=sys.stderr, flush=True)


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
    state = t.rec.load_checkpoint(partial(read_sharded, t))
    if state is None:
        t.rec.truncate_metrics(0)  # a start from scratch owns no earlier lines
        return False
    if "sharded" not in state:
        load_tensors(t, state)
    training(t.optimizer, t.model)  # a checkpoint holds the averaged weights: to the training ones
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


def read_sharded(t: Trained, path: Path, state: dict[str, Any]) -> None:
    """A sharded checkpoint's model and optimizer into `t` as this world size holds them
    (one process: whole), each rank reading and verifying only the byte ranges it needs; this
    rank's RNG and optimizer extras where the world size is the one that wrote them."""
    opts = optimizers(t.optimizer)
    first_states(opts)
    model, optimizer = fsdp.state_dicts(t.model, opts)
    sharded.load(path, "model", model, state["record"])
    sharded.load(path, "optimizer", optimizer, state["record"])
    rank, rngs, extras = distributed.rank(), state["rngs"], state["extras"]
    same = len(rngs) == distributed.world_size()
    state["rng"] = rngs[rank] if same else rngs[0]
    with loading_extras(opts, extras[rank] if same else extras[0]):
        fsdp.set_state_dicts(t.model, opts, model, optimizer)


@torch.no_grad()
def first_states(opts: list[torch.optim.Optimizer]) -> None:
    """Every state a step makes, made by one step of zero gradients at zero LR (the weights
    unchanged), for DCP to read the checkpoint's into: torch's helpers step only an optimizer
    with no states, and some keep states from the start (APOLLO its seeds)."""
    params = [p for o in opts for g in o.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for o in opts for g in o.param_groups]
    for o in opts:
        for g in o.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        o.step()
    for g, lr in zip((g for o in opts for g in o.param_groups), lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


@contextmanager
def loading_extras(opts: list[torch.optim.Optimizer],
                   extras: list[dict[str, Any]]) -> Iterator[None]:
    """Each optimizer's `load_state_dict` given its extras besides what torch passes it."""
    originals = [o.load_state_dict for o in opts]
    for opt, load, more in zip(opts, originals, extras, strict=True):
        opt.load_state_dict = partial(with_extras, load, more)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for opt in opts:
            del opt.load_state_dict


def with_extras(load: Any, extras: dict[str, Any], state_dict: dict[str, Any]) -> None:
    load({**state_dict, **extras})


def load_tensors(t: Trained, state: dict[str, Any]) -> None:
    """A one-process (or DDP) checkpoint's tensors, as this world size holds them."""
    if t.sharded:  # a whole model: each rank keeps its rows
        fsdp.load_whole(t.model, state["model"])
    else:
        t.model.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    if t.sharded:
        fsdp.shard_states(t.optimizer.state)
