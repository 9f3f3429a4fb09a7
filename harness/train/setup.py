"""A trial's training setup in named steps, each a function of what the steps before it built;
`Trainer.__init__` (harness/train/loop.py) calls them in order: join → model → budget → method
→ modifiers → parallelize → compile → optimizer → schedule, then its own resume, wrap, and
meters and hooks."""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from harness import distributed
from harness.config import RunConfig, TrainConfig
from harness.config.steps import Steps
from harness.distributed import fsdp, materialize, pick_device
from harness.methods import Method, build_method, optimizer_for, schedule_of
from harness.methods.rank import rank_warning
from harness.modifiers import recompute
from harness.modifiers.multi_tensor import update_chunk
from harness.modifiers.offload import ActivationOffloader
from harness.modifiers.precision import Precision, pure_bf16
from harness.modifiers.recompute import decoder_layers
from harness.train import compiled, finetune, meta_build, pretrain
from harness.train.build import describe
from harness.trials import rng_state, set_rng_state

Data = pretrain.LMData | finetune.GlueData
Loss = Callable[[nn.Module, Any], torch.Tensor]


def join(run: RunConfig) -> tuple[Steps, torch.device]:
    """The step's shape, then this rank's device in the process group: the shape is checked
    before joining, so a batch that does not split is one line, not a hang."""
    steps = Steps.of(run.train, run.task.seq_len, distributed.world_size(),
                     local=distributed.local_world_size())
    return steps, distributed.init(pick_device(run.device))


@dataclass(frozen=True)
class Deferred:
    """A model built on the meta device (`model`), until `parallelize` fills its shards: the
    twins of its tensors, and the ordinary build to fall back on."""

    twins: materialize.Twins
    build: Callable[[], tuple[nn.Module, Any]]


# The meta-built models between the steps (`model` → `modifiers` → `parallelize`).
_deferred: weakref.WeakKeyDictionary[nn.Module, Deferred] = weakref.WeakKeyDictionary()


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def model(run: RunConfig, steps: Steps, device: torch.device) -> tuple[nn.Module, Any, Data]:
    """Model, tokenizer and data, built after seeding: every rank and every resume starts from
    the same weights and draws. Sharded: built on the meta device, each rank keeping its rows
    of the same weights (`_on_meta`)."""
    _seed(run.seed)
    glue = run.task.kind == "glue"
    build = partial((finetune if glue else pretrain).build, run)
    built, tok = build() if steps.shards == 1 else _on_meta(build, run, steps)
    distributed.say(f"model {run.model}: {describe(built)}")
    data = (finetune.GlueData if glue else pretrain.LMData)(run, tok, device, steps)
    return built, tok, data


def _on_meta(build: Callable[[], tuple[nn.Module, Any]], run: RunConfig,
             steps: Steps) -> tuple[nn.Module, Any]:
    """`build` on the meta device, twinned with this rank's rows in its shard group
    (harness/train/meta_build.py: from the seed, or read from weight files); an op the twins
    cannot follow, or weights they cannot read: the ordinary build, from the seed."""
    twins = materialize.Twins(distributed.rank() % steps.shards, steps.shards)
    try:
        built, tok = meta_build.build(run, twins, build)
    except materialize.Unsupported as e:
        distributed.say(f"model: built whole on every rank ({e})")
        _seed(run.seed)
        return build()
    _deferred[built] = Deferred(twins, build)
    return built, tok


def budget(run: RunConfig, data: Data) -> RunConfig:
    """A budget in epochs (passes over the training set) as optimizer steps, which the method
    and its schedule then read; a budget in steps unchanged."""
    t = run.train
    if not t.epochs:
        return run
    steps = t.epochs * data.steps_per_epoch
    return run.model_copy(update={"train": t.model_copy(update={"steps": steps})})


def method(run: RunConfig, steps: Steps, built: nn.Module) -> tuple[Method, list[str]]:
    """The method, and its warnings about this model's shapes: said now, kept for the summary."""
    chosen = build_method(run, steps)
    shapes = {n: p.shape for n, p in built.named_parameters()}
    said = (rank_warning(chosen, shapes), chosen.check(run).warning)
    warnings = [line for line in said if line]
    for line in warnings:
        distributed.say(f"warning: {line}")
    return chosen, warnings


def modifiers(built: nn.Module, chosen: Method, run: RunConfig,
              device: torch.device) -> tuple[nn.Module, ActivationOffloader | None]:
    """The model on its device, cast (bf16-true), prepared by the method, and its decoder
    layers recomputed or offloaded as `memory` asks; returns it and the offloader, if any."""
    t = run.train
    deferred = _deferred.pop(built, None)
    if deferred is not None:
        built = _prepare_meta(built, deferred, chosen, run, device)
        return built, recompute.apply(built, run.memory, device)
    # bf16-true: before and after `prepare`. Cast on the host, before the move: on CUDA the
    # device then never holds the float32 model (cast there one tensor at a time, the freed
    # blocks left in the allocator's cache), and half the bytes cross PCIe. The same rounding
    # either way; on a CPU the move does nothing.
    built = pure_bf16(built, t).to(device)
    built = pure_bf16(chosen.prepare(built, run), t)
    return built, recompute.apply(built, run.memory, device)


def _prepare_meta(built: nn.Module, deferred: Deferred, chosen: Method, run: RunConfig,
                  device: torch.device) -> nn.Module:
    """`modifiers`' cast and `prepare` on a meta-built model, its twins following; an op they
    cannot follow: the model built the ordinary way from the seed, the generators then put back
    as they were before `prepare` (the meta build drew what the ordinary one draws)."""
    t, before = run.train, rng_state()

    def cast_and_prepare(model: nn.Module, to: torch.device | None = None) -> nn.Module:
        return pure_bf16(chosen.prepare(pure_bf16(model, t).to(to), run), t)

    try:  # on the meta device until `parallelize` fills the shards on `device`
        prepared = deferred.twins.run(cast_and_prepare, built)
    except materialize.Unsupported as e:
        distributed.say(f"model: built whole on every rank ({chosen.name}: {e})")
        _seed(run.seed)
        whole = deferred.build()[0]
        set_rng_state(before)
        return cast_and_prepare(whole, device)
    _deferred[prepared] = deferred
    return prepared


def parallelize(built: nn.Module, run: RunConfig, steps: Steps, device: torch.device) -> bool:
    """fsdp or hsdp over several processes: sharded per decoder layer (hsdp: within each shard
    group), before the optimizer, whose parameters are then the shards; a meta-built model's
    shards then filled with this rank's rows, any other's weights rank 0's; returns whether it
    sharded. DDP wraps later (Trainer._wrap): how depends on the optimizer
    (layer-wise ones reduce in hooks)."""
    t = run.train
    if steps.world == 1 or not t.sharded:
        return False
    deferred = _deferred.pop(built, None)
    if deferred is None:
        distributed.broadcast_(built)  # rank 0's weights, as DDP starts from them
    else:  # built on the meta device: every rank computed its rows of the same draws
        values = deferred.twins.values(built)
    offload = run.memory.optimizer_offload == "host" and device.type == "cuda"
    fsdp.shard(built, decoder_layers(built), device, t.reshard_after_forward, offload,
               steps.shards)
    if deferred is not None:
        materialize.fill(built, values, torch.device("cpu") if offload else device)
    return True


def compile_model(built: nn.Module, data: Data, t: TrainConfig, out: Path) -> Loss:
    """`compile` on: each decoder layer compiled in place (after recompute wrapped it) and the
    data's head loss (harness/train/compiled.py), with inductor's cache in the sweep's folder
    or `out`; the loss the loop calls, whose modules and state_dict keys stay the eager ones."""
    if t.compile:
        compiled.keep_cache(out)
        compiled.apply(built, data)
    return data.loss


def optimizer(chosen: Method, built: nn.Module, run: RunConfig,
              device: torch.device) -> tuple[torch.optim.Optimizer, Precision]:
    """The method's optimizer over the (sharded) model, and the precision context and fp16
    grad scaler its steps run under (autocast under fsdp too: harness/distributed/fsdp.py)."""
    precision = Precision(run.train, device)
    chunk = update_chunk(run.train, device.type)  # the device's where the run leaves it
    run = run.model_copy(update={"train": run.train.model_copy(update={"update_chunk": chunk})})
    return optimizer_for(chosen, built, run), precision


def schedule(opt: torch.optim.Optimizer, chosen: Method,
             run: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR as the method's factor of `train.lr` at each step (warmup, then decay)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, schedule_of(chosen, run))
