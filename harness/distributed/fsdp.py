"""FSDP2 for one trial (`train.parallel: fsdp`): every decoder layer and the root module sharded
over the data-parallel ranks with torch's `fully_shard`, so that a rank holds 1/W of each
weight, gradient and optimizer state and gathers one layer's weights while that layer runs.

A sharded parameter is a DTensor split on dim 0: rank r holds rows [r·c, r·c + c) with
c = ceil(m / W), the last ranks fewer (or none). FSDP reduce-scatters each layer's gradients in
its backward, averaged over ranks as DDP's all-reduce is, and runs the parameters'
post-accumulate-grad hooks on the sharded gradient (layer-wise updates work unchanged). The
helpers below are how methods and modifiers see a parameter that may be sharded (`local`,
`full`, `rows`), so that none of them tests for DTensor itself.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from harness import distributed

# Mixed precision as FSDP does it: the float32 shards are the master weights, gathered in the
# compute dtype; gradients are reduced in float32. Other precisions: the weights' own dtype.
COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    dtype = COMPUTE.get(precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard(model: nn.Module, layers: Iterable[nn.Module], device: torch.device, precision: str,
          reshard_after_forward: bool, offload: bool) -> None:
    """`fully_shard` on each of `layers`, then on the root (embeddings, final norm, head). The
    root stays gathered after forward, since backward starts there; each layer frees its
    gathered weights after its forward when `reshard_after_forward` (gathered again for its
    backward), or keeps them to save that all-gather. `offload`: FSDP's CPU offload, the
    sharded weights, gradients and optimizer states on the host, the step run there."""
    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    common = {"mesh": mesh, "mp_policy": mixed_precision(precision), "offload_policy": policy}
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **common)
    fully_shard(model, **common)


def is_sharded(t: torch.Tensor | None) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded tensor, a view (writes reach the shard); else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather when sharded); else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def rows(t: torch.Tensor) -> slice:
    """The rows of the whole tensor that this rank's shard holds (all of them unsharded)."""
    if not isinstance(t, DTensor):
        return slice(0, t.shape[0])
    world, rank = distributed.world_size(), distributed.rank()
    chunk = -(-t.shape[0] // world)
    start = min(rank * chunk, t.shape[0])
    return slice(start, min(start + chunk, t.shape[0]))


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value`, this rank's rows of a tensor shaped as `param`, as a sharded tensor placed as
    `param` is (plain `value` when `param` is not sharded): optimizer states in this form are
    saved and resharded by torch.distributed.checkpoint like the weights."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def gathered(obj: Any) -> Any:
    """`obj` (nested dicts, lists, tuples) with every sharded tensor made whole, on the host: a
    trial's checkpoint is then the one a single process writes, and loads at any world size.
    Collective: every rank calls it on the same structure (the all-gathers pair up in order)."""
    if isinstance(obj, DTensor):
        return obj.full_tensor().cpu()
    if isinstance(obj, dict):
        return {k: gathered(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(gathered(v) for v in obj)
    return obj


def shard_states(states: dict[Any, dict[str, Any]]) -> None:
    """An optimizer's per-parameter states, loaded whole from a checkpoint, cut to this rank's
    rows and placed as their parameter is: every tensor shaped as its (sharded) parameter."""
    for param, state in states.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                    and value.shape == param.shape:
                state[key] = like(value[rows(param)].to(param.device), param)


def load_whole(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A whole model state (a checkpoint's) into a sharded model: each rank keeps its rows."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def rows_whole(state: dict[str, Any], param: torch.Tensor, whole: Collection[str]) -> dict:
    """An optimizer state kept as plain tensors of this rank's rows (dim 0 the shard's rows,
    keys outside `whole`, which every rank holds entire) with those tensors placed as row
    shards of the whole: `gathered` then writes them whole, as one process would."""
    if not isinstance(param, DTensor):
        return state
    span = rows(param)
    out = dict(state)
    for key, value in state.items():
        if key in whole or not _holds_rows(value, span):
            continue
        shape = (param.shape[0], *value.shape[1:])
        out[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                      run_check=False, shape=shape,
                                      stride=torch.empty(shape, device="meta").stride())
    return out


def rows_cut(state: dict[str, Any], param: torch.Tensor, whole: Collection[str]) -> None:
    """The inverse of `rows_whole` on load: each whole tensor of the parameter's rows (dim 0
    the parameter's, keys outside `whole`) cut to this rank's rows, in place."""
    if not isinstance(param, DTensor):
        return
    for key, value in state.items():
        if key not in whole and isinstance(value, torch.Tensor) and value.dim() \
                and value.shape[0] == param.shape[0]:
            state[key] = value[rows(param)].clone()


def _holds_rows(value: Any, span: slice) -> bool:
    return (isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0
            and value.shape[0] == span.stop - span.start)
