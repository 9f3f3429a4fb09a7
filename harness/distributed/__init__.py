"""Data parallelism for one trial: W processes, set up from torchrun's environment.

RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are read as torchrun (or a sweep's
launcher, which translates its scheduler's variables into these) sets them; without
WORLD_SIZE, or with 1, every helper here is a no-op and the trial is the ordinary single
process. The backend is gloo on CPU and nccl on CUDA, one GPU per process (cuda:LOCAL_RANK).

Rank and world size are read from the environment until the group exists, so the trial can
decide who writes the run folder before joining: only rank 0 writes (`main_only`).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.errors import UserError

# A collective that waits this long fails instead of hanging: longer than the slowest thing one
# rank does alone (rank 0 writing a checkpoint), as torch's default for gloo. A peer that is
# gone or stopped is found sooner, by the watchdog (train.peer_timeout_s).
TIMEOUT = timedelta(minutes=30)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if active():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0")) if world_size() > 1 else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """The processes on this node (LOCAL_WORLD_SIZE, as torchrun sets it); unset, all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size())))


def is_main() -> bool:
    return rank() == 0


def say(*args: Any) -> None:
    """Progress lines come from rank 0 only; W copies of every line would bury them."""
    if is_main():
        print(*args, flush=True)


def init(device: torch.device) -> torch.device:
    """Join the process group the environment names; returns this process's device."""
    if world_size() == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    if not active():
        backend = "nccl" if device.type == "cuda" else "gloo"
        bound = {"device_id": device} if device.type == "cuda" else {}  # NCCL: connect now
        dist.init_process_group(backend, timeout=TIMEOUT, **bound)
        print(f"rank {rank()}/{world_size()}: {backend} on {device}", file=sys.stderr, flush=True)
    return device


def teardown(failed: bool = False, meet: bool = False) -> None:
    """Leave the group. After a failure or a lost peer, abort: a clean destroy could wait on
    peers forever. `meet`: the ranks meet first (all of them end here), so that none takes
    the store it hosts away while a peer's watchdog (harness/distributed/watchdog.py) still
    reads it."""
    if not active():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and abort is not None:
        abort()
        return
    if meet and not failed:
        dist.barrier()
    dist.destroy_process_group()


def barrier() -> None:
    if active():
        dist.barrier()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (gloo has no average: divide by `world_size()` where needed)."""
    if active():
        dist.all_reduce(t)
    return t


def every_rank(obj: Any) -> list[Any]:
    """Each rank's `obj`, in rank order, on every rank (`[obj]` in one process)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on one: a stop or prune decided by one rank is
    taken by all at the same step, so none waits at a collective the others have left."""
    if not active():
        return flag
    return bool(all_sum(torch.tensor([float(flag)], device=device)).item() > 0)


def broadcast_(module: nn.Module) -> None:
    """Rank 0's parameters and buffers everywhere, as DDP's constructor does for its model."""
    if active():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def wrap(model: nn.Module, device: torch.device, layerwise: bool) -> nn.Module:
    """DDP, which all-reduces gradients in buckets during the last micro-batch's backward; or,
    for a layer-wise optimizer (whose hooks reduce each gradient), the model itself, started
    from rank 0's weights."""
    if not active():
        return model
    if layerwise:
        broadcast_(model)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def trainable(model: nn.Module) -> list[int]:
    """The parameters DDP reduces (by id): it must be rebuilt when this set changes."""
    return [id(p) for p in model.parameters() if p.requires_grad]


def check_same(module: nn.Module, step: int) -> None:
    """Ranks must hold the same weights: a float64 checksum each, compared by max and min.
    Anything that updates weights outside the all-reduced gradients (ReLoRA's merges, GaLore's
    SVDs) is deterministic given equal gradients and seeds; this catches it if it is not."""
    if not active():
        return
    tensors = [*module.parameters(), *module.buffers()]
    total = torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors]).sum()
    both = torch.stack([total, -total])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = float(both[0]), -float(both[1])
    if high != low and torch.isfinite(both).all():
        raise RuntimeError(
            f"data-parallel ranks hold different weights at step {step} "
            f"(checksums {low!r} to {high!r}): an update is not deterministic across ranks"
        )


class MainOnly:
    """A run folder seen from a rank other than 0: reads pass through, every write is a no-op.
    One place enforces "only rank 0 writes", whatever write methods Records grows."""

    # reads, and the one write every rank takes part in (each writes its own shards)
    PASSED = frozenset({"summary", "load_checkpoint", "save_sharded_checkpoint"})

    def __init__(self, records: Any) -> None:
        self._records = records

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._records, name)
        if callable(value) and name not in self.PASSED:
            return _nothing
        return value


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def main_only(records: Any) -> Any:
    return records if is_main() else MainOnly(records)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "device: 'cuda' asked for but no CUDA device is visible (allowed: auto, cpu)"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
