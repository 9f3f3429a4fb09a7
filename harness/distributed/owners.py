"""Work on whole matrices that FSDP holds by rows, done once, by one rank each: which rank
computes which matrix (`assign`: balanced by cost, the same on every rank), and the two trips,
each one all-to-all for every matrix of a step: `to_owners` brings each matrix whole to its
owner from every rank's rows, `from_owners` brings each rank its rows (or, for a result every
rank needs, the whole) of every owner's results. Muon's Newton–Schulz iteration and GaLore's and
Fira's SVD refreshes run so: a rank computes about 1/W of the matrices instead of all of them,
as microsoft/dion's and torchtitan's distributed Muon do. The ranks are those that split the
tensors (fsdp: all; hsdp: a shard group, each replica group doing the same work on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness import distributed
from harness.distributed import fsdp

# The work of each kind given to each rank so far in this process, by kind and number of ranks
# sharing it: a layer-wise optimizer assigns one matrix a call, which then goes to the rank with
# the least so far. Every rank makes the same calls in the same order (they are collective), so
# every rank keeps the same ledger.
_given: dict[tuple[str, int], list[int]] = {}


def assign(costs: Sequence[int], world: int, loads: list[int] | None = None) -> list[int]:
    """The rank that computes each matrix: the costliest first, each to the rank with the least
    work (`loads`, added to in place: each rank's so far; default none), ties to the lowest.
    Deterministic."""
    loads = [0] * world if loads is None else loads
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        best = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = best
        loads[best] += costs[i]
    return owners


def share(kind: str, costs: Sequence[int], world: int) -> list[int]:
    """`assign` after the work of this `kind` (costs in one unit) this process gave out
    before (the ledger, kept up to date)."""
    loads = _given.setdefault((kind, world), [0] * world)
    owners = assign(costs, world, loads)
    least = min(loads)
    loads[:] = [x - least for x in loads]  # only the differences matter
    return owners


def ranks() -> tuple[int, int]:
    """How many ranks share the work, and this one's place among them (1, 0 unsharded)."""
    if not distributed.active():
        return 1, 0
    return fsdp.shard_ranks()


@dataclass(frozen=True)
class Part:
    """One matrix of a trip: its whole shape, the rank that computes it, and whether each rank
    holds (or gets) its rows of it (`rows`: FSDP's layout, fsdp.span) or the whole of it."""

    shape: tuple[int, ...]
    owner: int
    rows: bool = True

    def held(self, rank: int, world: int) -> tuple[slice, tuple[int, ...]]:
        """Which rows of the whole `rank` holds (or gets) and their shape."""
        m = self.shape[0]
        span = fsdp.span(m, rank, world) if self.rows else slice(0, m)
        return span, (span.stop - span.start, *self.shape[1:])


def to_owners(local: Sequence[torch.Tensor], parts: Sequence[Part]) -> list[torch.Tensor | None]:
    """Each matrix whole on its owner (None on the other ranks), from every rank's rows
    (`local`, this rank's rows of each): one all-to-all for all of them. Unsharded, `local`."""
    world, me = ranks()
    if world == 1:
        return list(local)
    ref = local[0]
    send = [[x.reshape(-1) for x, p in zip(local, parts, strict=True) if p.owner == dest]
            for dest in range(world)]
    mine = [i for i, p in enumerate(parts) if p.owner == me]
    sizes = [sum(_numel(parts[i].held(src, world)[1]) for i in mine) for src in range(world)]
    chunks = _exchange(send, sizes, ref.dtype, ref.device)
    wholes: list[torch.Tensor | None] = [None] * len(parts)
    for i in mine:
        wholes[i] = torch.empty(parts[i].shape, dtype=ref.dtype, device=ref.device)
    for src, chunk in enumerate(chunks):
        at = 0
        for i in mine:
            span, shape = parts[i].held(src, world)
            n = _numel(shape)
            wholes[i][span].copy_(chunk[at:at + n].view(shape))  # type: ignore[index]
            at += n
    return wholes


def from_owners(results: Sequence[torch.Tensor | None], parts: Sequence[Part],
                dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """This rank's rows (a `rows` part) or the whole (any other) of each owner's result
    (`results`: this rank's where it owns the part, else None), all of `dtype`: one all-to-all
    for all of them. The answers are views of one buffer. Unsharded, `results`."""
    world, me = ranks()
    if world == 1:
        return list(results)  # type: ignore[arg-type]
    send = [[results[i][p.held(dest, world)[0]].reshape(-1)  # type: ignore[index]
             for i, p in enumerate(parts) if p.owner == me] for dest in range(world)]
    held = [p.held(me, world)[1] for p in parts]
    sizes = [sum(_numel(held[i]) for i, p in enumerate(parts) if p.owner == src)
             for src in range(world)]
    chunks = _exchange(send, sizes, dtype, device)
    out: list[torch.Tensor | None] = [None] * len(parts)
    for src, chunk in enumerate(chunks):
        at = 0
        for i, p in enumerate(parts):
            if p.owner == src:
                n = _numel(held[i])
                out[i] = chunk[at:at + n].view(held[i])
                at += n
    return out  # type: ignore[return-value]


def _exchange(send: list[list[torch.Tensor]], sizes: list[int], dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
    """`send[r]` (flat tensors) to rank r, and `sizes[r]` values from each rank r back."""
    pieces = [t for to in send for t in to]
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(sizes), dtype=dtype, device=device)
    dist.all_to_all_single(out, flat.to(dtype), sizes, [sum(t.numel() for t in to)
                                                        for to in send],
                           group=fsdp.shard_group())
    return list(out.split(sizes))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
