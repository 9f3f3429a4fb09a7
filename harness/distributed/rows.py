"""What an optimizer needs of a tensor that FSDP may have split by rows, behind one helper:
`Rows(t)` gives this rank's rows, the whole tensor gathered, sums over the ranks that each hold
a part, and states saved and loaded by rows (work on whole matrices spread over the ranks, one
rank a matrix: harness/distributed/owners.py).
Methods ask it and nothing else of the strategy: none tests for DTensor or calls the process
group itself. Unsharded (one process, or DDP) each answer is the tensor itself and a sum is
one process's (harness/distributed/fsdp.py has the layout: rank r holds rows
[r·c, r·c + c), c = ceil(m / W)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist

from harness import distributed
from harness.distributed import fsdp, owners


class Rows:
    """A parameter, its gradient or a state shaped as it, as this rank holds it."""

    # Work on whole matrices, one rank a matrix (harness/distributed/owners.py): who computes
    # which, and the all-to-alls there and back.
    Part = owners.Part
    assign = staticmethod(owners.assign)
    share = staticmethod(owners.share)
    to_owners = staticmethod(owners.to_owners)
    from_owners = staticmethod(owners.from_owners)
    workers = staticmethod(owners.ranks)

    def __init__(self, t: torch.Tensor | None) -> None:
        self.tensor = t
        self.sharded = fsdp.is_sharded(t)

    @property
    def local(self) -> torch.Tensor:
        """This rank's rows, a view (writes reach the shard); unsharded, the tensor."""
        return fsdp.local(self.tensor)

    @property
    def span(self) -> slice:
        """The rows of the whole tensor this rank holds (all of them unsharded)."""
        return fsdp.rows(self.tensor)

    def whole(self) -> torch.Tensor:
        """The whole tensor on every rank: an all-gather, every rank in the same order."""
        return fsdp.full(self.tensor)

    def placed(self, local: torch.Tensor) -> torch.Tensor:
        """`local`, this rank's rows of a tensor shaped as this one, placed as this one is (a
        state made from the local rows that the optimizer's own step takes with the weight's
        placement); unsharded, `local` itself."""
        return fsdp.like(local, self.tensor)

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `whole`, a tensor with the rows of this one (a left basis)."""
        return whole[self.span]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks in place where this tensor is split (each rank's part
        of a sum over its rows; hsdp: over its shard group, whose replicas FSDP averages the
        gradients of); else `t` as it is."""
        return fsdp.shard_sum(t) if self.sharded else t

    @staticmethod
    def total(t: torch.Tensor) -> torch.Tensor:
        """`t` summed in place over the ranks that split the tensors (a count or norm each rank
        took of its rows): every rank under fsdp, the shard group under hsdp."""
        return fsdp.shard_sum(t)

    @staticmethod
    def ranks() -> int:
        """The ranks a sharded tensor's rows are split over (hsdp: its shard group's)."""
        return fsdp.shard_ranks()[0]

    @staticmethod
    def layout() -> tuple[str, str]:
        """How the rows are split, as the config names it (fsdp over every process, or hsdp's
        shard group of them), and the setting that decides how many ranks split a tensor."""
        group, world = fsdp.shard_ranks()[0], distributed.world_size()
        if group == world:
            return f"train.parallel fsdp on {world} processes", "a world size"
        return (f"train.parallel hsdp on {world} processes (train.shard_group {group})",
                "a train.shard_group")

    @staticmethod
    def split_sum(t: torch.Tensor) -> torch.Tensor:
        """`t`, each rank's part of a sum (a left side's PᵀG), summed over the ranks that split
        the tensors, of which this rank keeps its rows (`mine_of`): a reduce-scatter, the
        same bytes as an all-reduce's first half."""
        world, _ = fsdp.shard_ranks()
        chunk = -(-t.shape[0] // world)
        padded = t.new_zeros((world * chunk, *t.shape[1:]))
        padded[:t.shape[0]] = t
        out = t.new_empty((chunk, *t.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=fsdp.shard_group())
        return out[:_count(Rows.mine_of(t.shape[0]))]

    @staticmethod
    def joined(t: torch.Tensor, rows: int) -> torch.Tensor:
        """`t`, this rank's rows (`mine_of`) of a tensor of `rows` rows, whole on every rank:
        an all-gather."""
        world, _ = fsdp.shard_ranks()
        chunk = -(-rows // world)
        padded = t.new_zeros((chunk, *t.shape[1:]))
        padded[:t.shape[0]] = t
        out = t.new_empty((world * chunk, *t.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=fsdp.shard_group())
        return out[:rows]

    @staticmethod
    def mine_of(rows: int) -> slice:
        """The rows of a `rows`-row tensor this rank keeps when it is split as the weights are
        (fsdp.span), whatever the weights' own rows."""
        world, rank = fsdp.shard_ranks()
        return fsdp.span(rows, rank, world)

    @staticmethod
    def aligned(shape: Iterable[int], block: int) -> bool:
        """Whether each rank's rows of a `shape` tensor are the same whole number of
        `block`-value blocks of the flattened tensor: then blockwise states on the shards
        are the whole's."""
        rows, *rest = shape
        world = fsdp.shard_ranks()[0]
        return rows % world == 0 and (rows // world) * math.prod(rest) % block == 0

    # -- an optimizer's states of this parameter, in checkpoints ------------------------------
    def save(self, state: dict[str, Any], whole: Collection[str]) -> dict[str, Any]:
        """A state kept as plain tensors of this rank's rows (dim 0 the shard's rows, keys
        outside `whole`, which every rank holds entire) with those tensors placed as row shards
        of the whole, which a checkpoint writes shard by shard and reads at any world size."""
        if not self.sharded:
            return state
        param, span = self.tensor, self.span
        out = dict(state)
        for key, value in state.items():
            if key in whole or not _holds_rows(value, span):
                continue
            out[key] = fsdp.row_shard(value, param, (param.shape[0], *value.shape[1:]))
        return out

    def load(self, state: dict[str, Any], whole: Collection[str]) -> None:
        """The inverse of `save` on load: each whole tensor of the parameter's rows (dim 0 the
        parameter's, keys outside `whole`) cut to this rank's rows, in place."""
        if not self.sharded:
            return
        m, span = self.tensor.shape[0], self.span
        _take(state, [k for k in state if k not in whole],
              lambda v: span if v.dim() and v.shape[0] == m else None)

    def save_blocks(self, state: dict[str, Any], keys: Collection[str],
                    blocks: int) -> dict[str, Any]:
        """Per-block values of this rank's rows (8-bit states' absmax: one a block of the
        flattened shard) placed as shards of the whole tensor's `blocks`; sound where every
        shard is a whole number of blocks and the ranks hold equal rows (`aligned`)."""
        if not self.sharded:
            return state
        return {k: fsdp.row_shard(v, self.tensor, (blocks,))
                if k in keys and isinstance(v, torch.Tensor) and not fsdp.is_sharded(v) else v
                for k, v in state.items()}

    def save_split(self, state: dict[str, Any], keys: Collection[str],
                   rows: int) -> dict[str, Any]:
        """States `keys` kept by `mine_of` rows of a `rows`-row tensor, placed as row shards of
        it (as `save` does for the parameter's own rows)."""
        if not self.sharded:
            return state
        return {k: fsdp.row_shard(v, self.tensor, (rows, *v.shape[1:]))
                if k in keys and isinstance(v, torch.Tensor) and not fsdp.is_sharded(v) else v
                for k, v in state.items()}

    def load_split(self, state: dict[str, Any], keys: Collection[str], rows: int) -> None:
        """The inverse of `save_split` on load: this rank's rows of each, in place."""
        if not self.sharded:
            return
        _take(state, keys, lambda v: Rows.mine_of(rows) if v.dim() and v.shape[0] == rows
              else None)

    def load_blocks(self, state: dict[str, Any], keys: Collection[str]) -> None:
        """The inverse of `save_blocks` on load: this rank's blocks of each whole tensor."""
        if not self.sharded:
            return
        _take(state, keys, lambda v: fsdp.rows(v, sharded=True))


def _holds_rows(value: Any, span: slice) -> bool:
    return (isinstance(value, torch.Tensor) and not fsdp.is_sharded(value) and value.dim() > 0
            and value.shape[0] == span.stop - span.start)


def _count(span: slice) -> int:
    return span.stop - span.start


def _take(state: dict[str, Any], keys: Iterable[str],
          part: Callable[[torch.Tensor], slice | None]) -> None:
    """Each of `keys` as this rank holds it, in place: a shard read from a sharded checkpoint
    is already its rows; a whole tensor (a one-process checkpoint's) is cut to `part` of it,
    where `part` names rows (None: kept whole)."""
    for key in keys:
        value = state.get(key)
        if fsdp.is_sharded(value):
            state[key] = value.to_local()
        elif isinstance(value, torch.Tensor) and (span := part(value)) is not None:
            state[key] = value[span].clone()
