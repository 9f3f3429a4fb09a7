"""FSDP2 for one trial (`train.parallel: fsdp`): every decoder layer and the root module sharded
over the data-parallel ranks with torch's `fully_shard`, so that a rank holds 1/W of each
weight, gradient and optimizer state and gathers one layer's weights while that layer runs.

A sharded parameter is a DTensor split on dim 0: rank r holds rows [r·c, r·c + c) with
c = ceil(m / W), the last ranks fewer (or none). FSDP reduce-scatters each layer's gradients in
its backward, averaged over ranks as DDP's all-reduce is, and runs the parameters'
post-accumulate-grad hooks on the sharded gradient (layer-wise updates work unchanged). The
helpers below are how the trainer and the modifiers see a parameter that may be sharded
(`local`, `full`, `rows`); methods ask one helper built on them (harness/distributed/rows.py
`Rows`), so that none of them tests for DTensor itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from harness import distributed

# torch's FSDP, DTensor and checkpoint modules are imported where they are used: together they
# take ~1 s of CPU to import (sympy among them), in every trial, worker and CLI process, most of
# which never shard. Until a sharded run imports them, no tensor can be a DTensor (`is_sharded`).
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

# Mixed precision is autocast's, as on one process and under DDP: the float32 shards are
# gathered in float32 and autocast casts per op (a policy gathering in bfloat16 would round
# norms and embeddings autocast keeps in float32; a separate group for those moves the order
# gradients add up in). Gradients are float32, so reduced in float32.


def mixed_precision() -> MixedPrecisionPolicy:
    """The weights' own dtype gathered, inputs never cast: autocast casts per op."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(cast_forward_inputs=False)


def shard(model: nn.Module, layers: Iterable[nn.Module], device: torch.device,
          reshard_after_forward: bool, offload: bool, shards: int | None = None) -> None:
    """`fully_shard` on each of `layers`, then on the root (embeddings, final norm, head). The
    root stays gathered after forward, since backward starts there; each layer frees its
    gathered weights after its forward when `reshard_after_forward` (gathered again for its
    backward), or keeps them to save that all-gather. `offload`: FSDP's CPU offload, the
    sharded weights, gradients and optimizer states on the host, the step run there. `shards`:
    hsdp's shard group (`device_mesh`); None: every rank's (fsdp)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = device_mesh(device, shards)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    common = {"mesh": mesh, "mp_policy": mixed_precision(), "offload_policy": policy}
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **common)
    fully_shard(model, **common)


_mesh: DeviceMesh | None = None  # the last sharded model's (`device_mesh`); its last dim shards


def device_mesh(device: torch.device, shards: int | None = None) -> DeviceMesh:
    """The ranks a model is sharded over, kept for `rows` and `shard_sum`: fsdp (`shards` None
    or the world size) a 1-D mesh of every rank; hsdp a 2-D one ("replicate", "shard") of
    world / shards groups of `shards` consecutive ranks (a node's, as torchrun numbers them),
    each group holding the whole model once, FSDP reduce-scattering within a group and
    all-reducing across groups."""
    from torch.distributed.device_mesh import init_device_mesh

    global _mesh
    world = distributed.world_size()
    shards = shards or world
    shape, names = ((world,), ("shard",)) if shards == world else \
        ((world // shards, shards), ("replicate", "shard"))
    _mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return _mesh


def shard_ranks() -> tuple[int, int]:
    """How many ranks split a sharded tensor, and this rank's place among them: its shard
    group's size and its position in it (fsdp: the world size and its rank)."""
    if _mesh is None or not distributed.active():
        return distributed.world_size(), distributed.rank()
    return _mesh.size(_mesh.ndim - 1), _mesh.get_local_rank(_mesh.ndim - 1)


def shard_group() -> dist.ProcessGroup | None:
    """The process group of this rank's shard group (None: every rank's, the default group)."""
    return None if _mesh is None else _mesh.get_group(_mesh.ndim - 1)


def shard_sum(t: torch.Tensor) -> torch.Tensor:
    """`t` summed in place over the ranks of this rank's shard group (each one's part of a sum
    over a sharded tensor's rows): every rank under fsdp; the replicas under hsdp hold the same
    parts and are not added."""
    if not distributed.active():
        return t
    dist.all_reduce(t, group=shard_group())
    return t


def is_sharded(t: Any) -> bool:
    """Whether `t` is a DTensor (a sharded tensor)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def regather(model: nn.Module) -> None:
    """Every sharded module's gathered weights dropped, so that its next forward gathers the
    shards again: for shards changed in place outside a step (Schedule-Free's switch between
    its points), which the root's weights, kept gathered after a forward with no backward,
    would otherwise not show."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded tensor, a view (writes reach the shard); else `t` itself."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather when sharded); else `t` itself."""
    return t.full_tensor() if is_sharded(t) else t


def rows(t: torch.Tensor, sharded: bool = False) -> slice:
    """The rows of the whole tensor that this rank's shard holds (all of them unsharded);
    `sharded`: as if `t` were row-sharded over the ranks. Under hsdp a rank's rows are its
    place in its shard group (`shard_ranks`)."""
    if not (sharded or is_sharded(t)):
        return slice(0, t.shape[0])
    world, rank = shard_ranks()
    return span(t.shape[0], rank, world)


def span(rows: int, rank: int, world: int) -> slice:
    """The rows of `rows` that `rank` of `world` holds: [r·c, r·c + c), c = ceil(rows / world)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return slice(start, min(start + chunk, rows))


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value`, this rank's rows of a tensor shaped as `param`, as a sharded tensor placed as
    `param` is (plain `value` when `param` is not sharded): optimizer states in this form are
    saved and resharded by torch.distributed.checkpoint like the weights."""
    if not is_sharded(param):
        return value
    return row_shard(value, param, param.shape)


def row_shard(local: torch.Tensor, ref: DTensor, shape: Iterable[int]) -> DTensor:
    """`local`, this rank's rows of a tensor of `shape`, placed as the sharded `ref` is."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size(shape)
    return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride())


def state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizers' state dicts as torch.distributed.checkpoint saves and
    loads them (`get_state_dict`): keys by parameter name, the optimizers' flattened
    (`state.<name>.<key>`), a sharded tensor as this rank's part of a DTensor. An optimizer
    without states yet takes one step of zero gradients at zero LR to make them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizers,
                          options=StateDictOptions(flatten_optimizer_state_dict=True))


def set_state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer],
                    model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
    """The inverse of `state_dicts` (`set_state_dict`): each optimizer's `load_state_dict`
    gets its states by parameter, as its own `state_dict` gave them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizers, model_state_dict=model_state,
                   optim_state_dict=optimizer_state,
                   options=StateDictOptions(flatten_optimizer_state_dict=True))


def shard_states(states: dict[Any, dict[str, Any]]) -> None:
    """An optimizer's per-parameter states, loaded whole from a checkpoint, cut to this rank's
    rows and placed as their parameter is: every tensor shaped as its (sharded) parameter."""
    for param, state in states.items():
        if not is_sharded(param):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not is_sharded(value) \
                    and value.shape == param.shape:
                state[key] = like(value[rows(param)].to(param.device), param)


def load_whole(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A whole model state (a checkpoint's) into a sharded model: each rank keeps its rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
