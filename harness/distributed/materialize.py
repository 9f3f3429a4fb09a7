"""Construction on the meta device for fsdp: a model built and prepared with every tensor on
the meta device, each with a CPU twin holding what the ordinary CPU build would hold, but of a
parameter only this rank's rows (fsdp.py's split: rows [r·c, r·c + c), c = ceil(m / W)).

Every op the build runs on the meta tensors runs on their twins too, in the same order, on the
same default CPU generator: a random fill of a parameter draws a whole-sized scratch on the CPU
(the same draws, so the same stream afterwards) and keeps this rank's rows of it. The weights are
then bitwise the CPU build's, and a rank holds 1/W of the model plus one whole tensor at a time.
After `fully_shard` (on the meta model), `fill` gives each shard its rows and each buffer its
value. An op on a parameter that cannot be computed from its rows alone (a matmul, a reduction)
raises `Unsupported`; the caller then builds the ordinary way."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from harness.distributed import fsdp

if TYPE_CHECKING:
    from harness.distributed.weights import Weights

aten = torch.ops.aten
# The twins' device, said outright: a build may run inside a `torch.device` context.
CPU = torch.device("cpu")
# Fills that draw from the generator: on a parameter, drawn whole on a scratch, rows kept.
RANDOM = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float,
          aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
          aten.exponential_.default, aten.log_normal_.default, aten.cauchy_.default,
          aten.geometric_.default}
# Ops a parameter's rows give exactly: in place, elementwise with scalars (or a tensor shaped
# as the target), and out of place, elementwise over the whole parameter.
IN_PLACE = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default,
            aten.mul_.Scalar, aten.mul_.Tensor, aten.add_.Scalar, aten.add_.Tensor,
            aten.sub_.Tensor, aten.div_.Scalar, aten.div_.Tensor, aten.clamp_.default,
            aten.erfinv_.default, aten.masked_fill_.Scalar}
EMPTY = {aten.empty.memory_format, aten.empty_strided.default}
ELEMENTWISE = {aten._to_copy.default, aten.clone.default, aten.mul.Tensor, aten.mul.Scalar,
               aten.div.Tensor, aten.div.Scalar, aten.add.Tensor, aten.neg.default}


class Unsupported(Exception):
    """An op of the build that the twins cannot follow: the model is built the ordinary way."""


@dataclass
class Twin:
    """What a meta storage holds on the CPU: all of it (`whole`, a buffer's or a tensor's on its
    way to becoming one), or a parameter's rows [lo, hi) of `shape` (`rows`); neither: made
    empty and not written yet (allocated when first read whole)."""

    whole: torch.UntypedStorage | None
    rows: torch.Tensor | None = None
    shape: tuple[int, ...] = ()
    lo: int = 0
    hi: int = 0


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Twins(TorchDispatchMode):
    """The mode a deferred build runs under (`run`): tensors made on the CPU are made on the
    meta device with a CPU twin; parameters keep this rank's rows (cut as a module registers
    them)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.twins: dict[int, Twin] = {}
        self.draw = True
        # one scratch for every whole draw, grown to the largest: no allocation per tensor, so
        # no freed blocks the allocator keeps resident between the rows kept
        self.scratch = torch.UntypedStorage(0)

    def run(self, fn: Callable[..., Any], *args: Any, draw: bool = True) -> Any:
        """`fn(*args)` with its new tensors on the meta device, twinned. `draw` False: random
        ops draw nothing, as on the meta device (a skeleton whose weights are read after)."""
        register = nn.Module.register_parameter
        self.draw = draw

        def registered(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None:
                self.cut(param)

        nn.Module.register_parameter = registered  # type: ignore[method-assign]
        try:
            with self:
                return fn(*args)
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]
            self.scratch = torch.UntypedStorage(0)  # not held between the setup's steps

    # -- twins of tensors

    def _add(self, meta: torch.Tensor, twin: Twin) -> None:
        key = _key(meta)
        self.twins[key] = twin
        weakref.finalize(meta.untyped_storage(), self.twins.pop, key, None)

    def twin(self, t: torch.Tensor) -> Twin:
        twin = self.twins.get(_key(t))
        if twin is None:
            raise Unsupported("a meta tensor made outside the build")
        return twin

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """The CPU tensor a meta tensor stands for (a view as `t` is of its storage)."""
        twin = self.twin(t)
        if twin.rows is not None:
            raise Unsupported("a parameter read whole")
        if twin.whole is None:
            twin.whole = torch.UntypedStorage(t.untyped_storage().nbytes())
        with no_dispatch():
            return torch.empty(0, dtype=t.dtype, device=CPU).set_(twin.whole, t.storage_offset(),
                                                                  t.shape, t.stride())

    def cut(self, param: torch.Tensor) -> None:
        """A parameter's twin cut to this rank's rows, as fsdp will shard it."""
        if not param.is_meta:
            raise Unsupported("a parameter made off the meta device")
        twin = self.twin(param)
        if twin.rows is not None:
            return
        if param.numel() * param.element_size() != param.untyped_storage().nbytes() \
                or not param.is_contiguous():
            raise Unsupported("a parameter that is a view of a larger tensor")
        mine = fsdp.span(param.shape[0] if param.dim() else 1, self.rank, self.world)
        lo, hi = mine.start, mine.stop
        with no_dispatch():
            if twin.whole is None:  # made empty: nothing to keep
                rows = torch.empty((hi - lo, *param.shape[1:]), dtype=param.dtype, device=CPU)
            else:
                rows = self.whole(param).reshape(-1, *param.shape[1:])[lo:hi].clone()
        self.twins[_key(param)] = Twin(None, rows, tuple(param.shape), lo, hi)

    # -- the ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        metas = [t for t in tensors if t.is_meta]
        if not self.draw and torch.Tag.nondeterministic_seeded in func.tags:
            return self._undrawn(func, args, kwargs, tensors)
        if func in EMPTY and not tensors:  # its twin allocated when first read whole
            out = func(*args, **(kwargs | {"device": "meta"}))
            self._add(out, Twin(None))
            return out
        if not tensors:  # a factory: made on the CPU (asked for on the meta device too)
            meta = kwargs.get("device") == torch.device("meta")
            return self._made(func(*args, **(kwargs | {"device": "cpu"} if meta else kwargs)))
        if not metas:
            return func(*args, **kwargs)
        if func.is_view:  # the same storage, so the same twin: nothing to compute
            return func(*args, **kwargs)
        if any(self.twin(t).rows is not None for t in metas):
            return self._on_rows(func, args, kwargs)
        return self._on_whole(func, args, kwargs)

    def _undrawn(self, func: Any, args: Any, kwargs: Any, tensors: list[torch.Tensor]) -> Any:
        """A random op on the meta device alone: the generator untouched, a new tensor's twin
        unwritten, a fill's target left as it was."""
        if tensors:
            if not all(t.is_meta for t in tensors):
                raise Unsupported(f"{func} on the CPU while nothing may be drawn")
            return func(*args, **kwargs)
        out = func(*args, **(kwargs | {"device": "meta"}))
        self._add(out, Twin(None))
        return out

    def _made(self, out: Any) -> Any:
        """A factory's result: made on the CPU, it becomes a meta tensor with that twin."""
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            return out
        meta = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        self._add(meta, Twin(out.untyped_storage()))
        return meta

    def _on_whole(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Every input whole: the op on the twins, and on the meta tensors for the result."""
        cpu_args, cpu_kwargs = tree_map(self._as_cpu, (args, kwargs))
        out = func(*cpu_args, **cpu_kwargs)
        if func is aten._local_scalar_dense.default or not _has_tensor(out):
            return out
        meta = func(*args, **kwargs)
        for m, c in zip(_leaves(meta), _leaves(out), strict=True):
            if m.is_meta and _key(m) not in self.twins:
                self._add(m, Twin(_laid_as(c, m).untyped_storage()))
        return meta

    def _as_cpu(self, x: Any) -> Any:
        return self.whole(x) if isinstance(x, torch.Tensor) and x.is_meta else x

    def _on_rows(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op on a parameter: a random or elementwise fill of rows of it, or an elementwise
        copy of all of it (a cast); any other needs rows this rank does not hold."""
        if func not in RANDOM | IN_PLACE | ELEMENTWISE:
            raise Unsupported(f"{func} on a parameter")
        meta = func(*args, **kwargs)
        if func in RANDOM:
            self._draw(func, args, kwargs)
        elif func in IN_PLACE:
            self._fill(func, args, kwargs)
        else:
            self._elementwise(func, args, kwargs, meta)
        return meta

    def _block(self, t: torch.Tensor) -> tuple[Twin, int, int, slice, slice]:
        """The parameter rows [a, b) a row-aligned view `t` covers, and the rows of it this
        rank holds: as slices of `t`'s rows and of the twin's."""
        twin = self.twin(t)
        assert twin.rows is not None
        per_row = math.prod(twin.shape[1:])
        if not t.is_contiguous() or t.storage_offset() % per_row or t.numel() % per_row:
            raise Unsupported("a view across a parameter's rows")
        a = t.storage_offset() // per_row
        b = a + t.numel() // per_row
        lo, hi = max(a, twin.lo), min(b, twin.hi)
        hi = max(lo, hi)
        return twin, a, b, slice(lo - a, hi - a), slice(lo - twin.lo, hi - twin.lo)

    def _draw(self, func: Any, args: Any, kwargs: Any) -> None:
        target = args[0]
        twin, a, b, mine, theirs = self._block(target)
        nbytes = target.numel() * target.element_size()
        with no_dispatch():
            if self.scratch.nbytes() < nbytes:
                self.scratch = torch.UntypedStorage(nbytes)
            scratch = torch.empty(0, dtype=target.dtype, device=CPU).set_(self.scratch, 0,
                                                                         target.shape)
            func(scratch, *args[1:], **kwargs)
            twin.rows[theirs].copy_(scratch.reshape(b - a, *twin.shape[1:])[mine])

    def _fill(self, func: Any, args: Any, kwargs: Any) -> None:
        target = args[0]
        twin, a, b, mine, theirs = self._block(target)
        rest = [self._rows_of(x, target, a, b, mine) for x in args[1:]]
        with no_dispatch():
            func(twin.rows[theirs], *rest, **kwargs)

    def _rows_of(self, x: Any, like: torch.Tensor, a: int, b: int, mine: slice) -> Any:
        """An operand of a fill: a scalar or single value as it is, one shaped as the target
        as the same rows of it."""
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta and self.twin(x).rows is not None:
            raise Unsupported("a parameter's rows with another parameter's")
        x = self._as_cpu(x)
        if x.numel() == 1:
            return x.reshape(())
        if x.shape != like.shape:
            raise Unsupported("a broadcast into a parameter's rows")
        with no_dispatch():
            return x.reshape(b - a, *self.twin(like).shape[1:])[mine]

    def _elementwise(self, func: Any, args: Any, kwargs: Any, meta: torch.Tensor) -> None:
        source = args[0]
        twin = self.twin(source)
        if source.shape != twin.shape or meta.shape != twin.shape or not source.is_contiguous():
            raise Unsupported(f"{func} on part of a parameter")
        rest = [self._rows_of(x, source, 0, twin.shape[0] if twin.shape else 1,
                              slice(twin.lo, twin.hi)) for x in args[1:]]
        cpu_kwargs = {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}
        with no_dispatch():
            rows = func(twin.rows, *rest, **cpu_kwargs)
        self._add(meta, Twin(None, rows, tuple(meta.shape), twin.lo, twin.hi))

    def read_rows(self, model: nn.Module, weights: Weights, fresh: Collection[str] = ()
                  ) -> set[str]:
        """Each parameter's rows read from `weights` (those rows alone), and each persistent
        buffer they hold whole, under its own name or with the base model's prefix added or
        dropped, as from_pretrained finds it, cast to the tensor's dtype as it casts; returns
        the names read. A parameter the files lack (other names, a head) is `Unsupported`
        unless `fresh` names it (drawn after, as from_pretrained draws a missing one)."""
        prefix = getattr(model, "base_model_prefix", "")
        where = weights.files[0].parent
        read, seen = set(), set()
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:  # tied: one tensor under two names, read once
                continue
            seen.add(id(t))
            key = _stored(name, weights, prefix)
            if key is None and (name in fresh or not isinstance(t, nn.Parameter)):
                continue
            if key is None:
                raise Unsupported(f"no weight {name} in {where}")
            if weights.parts[key].shape != tuple(t.shape) or not t.dim():
                raise Unsupported(f"{name} is shaped otherwise in {where}")
            twin = self.twin(t)
            lo, hi = (twin.lo, twin.hi) if twin.rows is not None else (0, t.shape[0])
            target = twin.rows if twin.rows is not None else self.whole(t)
            if hi > lo:
                target.copy_(weights.rows(key, lo, hi))
            read.add(name)
        return read

    # -- the sharded model's values

    def values(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each parameter's rows and each buffer's whole value, by name, before sharding."""
        out: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            self.cut(p)
            out[name] = self.twin(p).rows
        for name, b in model.named_buffers():
            out[name] = self.whole(b).clone() if b.is_meta else b.detach().clone()
        self.twins.clear()  # the values hold what is kept: each freed as `fill` takes it
        return out


def fill(model: nn.Module, values: dict[str, torch.Tensor], device: torch.device) -> None:
    """The sharded meta model on `device`: each shard made of this rank's rows (`Twins.values`,
    moved, not copied, where they are on `device` already) and each buffer of its value."""
    made: dict[int, nn.Parameter] = {}  # one new Parameter for each, tied names sharing it
    state = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            local = fsdp.like(values.pop(name).to(device), p)
            made[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
        state[name] = made[id(p)]
    model.load_state_dict(state, strict=False, assign=True)
    for name, value in values.items():  # buffers, persistent or not
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, value.to(device))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"meta tensors left after filling the sharded model: {left}")


def _stored(name: str, weights: Weights, prefix: str) -> str | None:
    """`name`'s key in `weights`: its own, or with the base model's prefix dropped or added."""
    dotted = f"{prefix}." if prefix else ""
    other = name.removeprefix(dotted) if dotted and name.startswith(dotted) else dotted + name
    return next((k for k in (name, other) if k in weights), None)


def _has_tensor(out: Any) -> bool:
    return bool(_leaves(out))


def _leaves(out: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]


def _laid_as(cpu: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """`cpu` in a storage laid out as `meta`'s, so that views of one map onto the other."""
    if cpu.stride() == meta.stride() and cpu.storage_offset() == meta.storage_offset():
        return cpu
    with no_dispatch():
        out = torch.empty_strided(meta.shape, meta.stride(), dtype=cpu.dtype, device=CPU)
        out.copy_(cpu)
    if meta.storage_offset():
        raise Unsupported("a new tensor at an offset of its storage")
    return out
