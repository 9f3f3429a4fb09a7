"""A trial's training setup in named steps, each a function of what the steps before it built;
`Trainer.__init__` (harness/train/loop.py) calls them in order: join → model → budget → method
→ modifiers → parallelize → compile → optimizer → schedule, then its own resume, wrap, and
meters and hooks."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from harness import distributed
from harness.config import RunConfig, TrainConfig
from harness.config.steps import Steps
from harness.distributed import fsdp, pick_device
from harness.methods import Method, build_method, optimizer_for, schedule_of
from harness.methods.rank import rank_warning
from harness.models import describe
from harness.modifiers import recompute
from harness.modifiers.multi_tensor import update_chunk
from harness.modifiers.offload import ActivationOffloader
from harness.modifiers.precision import Precision, pure_bf16
from harness.modifiers.recompute import decoder_layers
from harness.train import compiled, finetune, pretrain

Data = pretrain.LMData | finetune.GlueData
Loss = Callable[[nn.Module, Any], torch.Tensor]


def join(run: RunConfig) -> tuple[Steps, torch.device]:
    """The step's shape, then this rank's device in the process group: the shape is checked
    before joining, so a batch that does not split is one line, not a hang."""
    steps = Steps.of(run.train, run.task.seq_len, distributed.world_size(),
                     local=distributed.local_world_size())
    return steps, distributed.init(pick_device(run.device))


def model(run: RunConfig, steps: Steps, device: torch.device) -> tuple[nn.Module, Any, Data]:
    """Model, tokenizer and data, built after seeding: every rank and every resume starts from
    the same weights and draws."""
    torch.manual_seed(run.seed)
    random.seed(run.seed)
    np.random.seed(run.seed)
    glue = run.task.kind == "glue"
    built, tok = (finetune if glue else pretrain).build(run)
    distributed.say(f"model {run.model}: {describe(built)}")
    data = (finetune.GlueData if glue else pretrain.LMData)(run, tok, device, steps)
    return built, tok, data


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
    # bf16-true: before and after `prepare`. Cast on the host, before the move: on CUDA the
    # device then never holds the float32 model (cast there one tensor at a time, the freed
    # blocks left in the allocator's cache), and half the bytes cross PCIe. The same rounding
    # either way; on a CPU the move does nothing.
    built = pure_bf16(built, t).to(device)
    built = pure_bf16(chosen.prepare(built, run), t)
    return built, recompute.apply(built, run.memory, device)


def parallelize(built: nn.Module, run: RunConfig, steps: Steps, device: torch.device) -> bool:
    """fsdp or hsdp over several processes: rank 0's weights, sharded per decoder layer (hsdp:
    within each shard group), before the optimizer, whose parameters are then the shards;
    returns whether it sharded. DDP wraps later (Trainer._wrap): how depends on the optimizer
    (layer-wise ones reduce in hooks)."""
    t = run.train
    if steps.world == 1 or not t.sharded:
        return False
    distributed.broadcast_(built)  # rank 0's weights, as DDP starts from them
    fsdp.shard(built, decoder_layers(built), device, t.reshard_after_forward,
               run.memory.optimizer_offload == "host" and device.type == "cuda", steps.shards)
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
