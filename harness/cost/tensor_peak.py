"""The peak of live tensor bytes in a steady training step: `torch.cuda.max_memory_allocated`
on a GPU, and on the CPU, which keeps no allocator statistics, the profiler's memory timeline
of one step. `harness bench memory` checks the activation model against it, and `tracked`
records it as a CPU trial's `peak_memory_bytes`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch._C._profiler import _EventType, _TensorMetadata
from torch.profiler._memory_profiler import (
    Action,
    CategoryDict,
    Key,
    OpTree,
    SizeMap,
    TensorKey,
    _element_size,
)

from harness.cost.profile import SKIPPED, profiler
from harness.distributed import every_rank, say
from harness.errors import brief

PEAK = "peak_memory_bytes"
BY_RANK = "peak_memory_bytes_by_rank"  # fsdp ranks hold different shares: each one's peak

if TYPE_CHECKING:
    from harness.train import Trainer
    from harness.train.hooks import Step


def step_peak(trainer: Trainer, breakdown: bool = False) -> tuple[int, dict[str, int]]:
    """Run `trainer.fit()` (more than SKIPPED steps) and return the peak after the first SKIPPED
    steps; on CPU with `breakdown`, also its bytes by the profiler's categories (parameter,
    activation, ...), which need the Python stacks and torch's data-flow analysis: twice the
    time of the peak alone (1.8 s against 0.85 s a llama_micro method, 2 cores)."""
    if trainer.run.train.steps <= SKIPPED:
        raise ValueError(f"step_peak needs more than {SKIPPED} steps")
    if trainer.device.type == "cuda":
        def reset(step: Step) -> None:
            if step.number == SKIPPED:
                torch.cuda.reset_peak_memory_stats(trainer.device)

        trainer.hooks.on("step", reset)
        trainer.fit()
        return torch.cuda.max_memory_allocated(trainer.device), {}
    with profiler(1, trainer.device, memory=True, stacks=breakdown) as prof:
        trainer.hooks.on("step", lambda step: prof.step())
        trainer.fit()
    if not breakdown:
        return _peak(_timeline(prof))
    memory = prof._memory_profile()
    return _peak(memory.timeline, memory._categories)


@contextmanager
def tracked(trainer: Trainer, enabled: bool = True) -> Iterator[None]:
    """On a CPU, around `trainer.fit()`: the peak of live tensor bytes in the process's step
    SKIPPED + 1 (a steady one; the profiler records that step only; a shorter run, its last),
    put in `trainer.costs` as `peak_memory_bytes` as soon as the step ends, so the next
    checkpoint keeps it. Nothing on a GPU (max_memory_allocated is exact and free), nor in a
    resumed trial that has it already."""
    left = trainer.run.train.steps - trainer.step
    if not enabled or trainer.device.type == "cuda" or PEAK in trainer.costs or left <= 0:
        yield
        return

    def ready(prof: torch.profiler.profile) -> None:
        trainer.meter.pause()  # reading the timeline is not training
        peak = None
        try:
            peak = _peak(_timeline(prof))[0]
            trainer.costs[PEAK] = peak
        except Exception as e:  # the profiler's private event tree may change with torch (its
            # data-flow analysis, read before, asserted under DDP with layer-wise hooks): a
            # measurement must never end the trial it measures
            say(f"peak of live tensors not recorded: reading the profiler's memory events "
                f"failed ({brief(e)}); the summary keeps peak_rss_bytes")
        finally:
            peaks = every_rank(peak)  # every rank profiles the same step: in lockstep
            if trainer.sharded and all(peaks):
                trainer.costs[BY_RANK] = peaks
            trainer.meter.resume()

    with profiler(1, trainer.device, memory=True, on_trace_ready=ready,
                  skipped=min(SKIPPED, left - 1)) as prof:
        trainer.hooks.on("step", lambda step: prof.step())
        yield


Event = tuple[int, Action, tuple[object, int], int]  # time, action, (key, version), bytes


def _timeline(prof: torch.profiler.profile) -> list[Event]:
    """torch's memory timeline (MemoryProfile.timeline) without its data-flow graph and tensor
    categories, which only a breakdown needs, the same peak to the byte
    (tests/cost/test_tensor_peak.py). A tensor is created and destroyed where the allocator
    says; one that an op reads or the step frees, not allocated in the step, lived before it.
    In-place writes, which the graph tracks for the categories, move no bytes. Sizes follow
    torch's SizeMap (an allocation's bytes, else the largest extent an op's inputs show), read
    in this one walk of the events instead of its two, as a recorded step is read in every
    CPU trial and torch's whole analysis costs several times more."""
    tree = OpTree(prof.profiler.kineto_results)  # type: ignore[union-attr]
    events: list[Event] = []
    allocations: dict[TensorKey, int] = {}  # each tensor's bytes, from its first event
    extents: dict[TensorKey, int] = {}  # tensors seen before any allocation event of theirs
    read: set[TensorKey] = set()
    created: set[TensorKey] = set()
    live_unknown: set[tuple[int, torch.device]] = set()

    def seen(tensors: Iterable[_TensorMetadata | None], reading: bool) -> None:
        for t in tensors:
            key = TensorKey.from_tensor(t)
            if key is None or key in allocations:  # its allocation's bytes are its size
                continue
            if reading:
                read.add(key)
            if t is not None and t.layout == torch.strided:
                extents[key] = max(extents.get(key, 0), _extent(t))

    for event in tree.dfs():
        kind, fields = event.typed
        if kind == _EventType.TorchOp:
            seen(SizeMap._flat_tensor_inputs(fields), reading=True)
        elif kind == _EventType.PyCall:  # parameters and states, with Python stacks only
            for _, p, grad in fields.module.parameters if fields.module else ():
                seen((p, grad), reading=False)
            for p, grad, state in fields.optimizer.parameters if fields.optimizer else ():
                seen((p, grad, *(t for _, t in state)), reading=False)
        elif kind == _EventType.Allocation:
            time, size = event.start_time_ns, fields.alloc_size
            key = TensorKey.from_allocation(fields)
            if key is not None:
                nbytes = allocations.setdefault(key, abs(size))
                if size > 0:
                    created.add(key)
                events.append((time, Action.CREATE if size > 0 else Action.DESTROY, (key, 0),
                               nbytes))
            else:  # no tensor of its own (as torch's timeline: one key a device, by address)
                unknown, spot = (Key(fields.device), 0), (fields.ptr, fields.device)
                if size > 0:
                    bumped = spot in live_unknown
                    events.append((time, Action.INCREMENT_VERSION if bumped else Action.CREATE,
                                   unknown, size))
                    live_unknown.add(spot)
                else:
                    events.append((time, Action.DESTROY, unknown, -size))
                    if spot not in live_unknown:
                        events.append((-1, Action.PREEXISTING, unknown, -size))
                    live_unknown.discard(spot)
    before = (read | allocations.keys()) - created  # read, or freed, and not made in the step
    events += [(-1, Action.PREEXISTING, (k, 0), allocations[k] if k in allocations else extents[k])
               for k in before]
    events.sort(key=lambda e: (e[0], e[1].value))
    return events


def _extent(t: _TensorMetadata) -> int:
    """SizeMap's bytes of a tensor an op read: the elements its largest stride spans."""
    n = max(size * stride for size, stride in zip(t.sizes or [1], t.strides or [1], strict=True))
    return n * _element_size(t.dtype)


def _peak(timeline: Sequence[Event], categories: CategoryDict | None = None,
          ) -> tuple[int, dict[str, int]]:
    """The largest sum of live bytes in `timeline`, with its breakdown by torch's `categories`
    where given."""
    live: dict[object, tuple[int, str]] = {}
    current = peak = 0
    at_peak: Counter[str] = Counter()
    for _, action, (key, version), size in timeline:
        if action == Action.DESTROY:
            current -= live.pop(key, (0, ""))[0]
            continue
        bumped = action == Action.INCREMENT_VERSION  # written in place: same bytes, maybe a new
        old = live.get(key, (0, ""))[0]  # category (a gradient becoming an optimizer state)
        nbytes = old if bumped and old else size
        category = categories.get(key, version + bumped) if categories is not None else None
        live[key] = (nbytes, category.name.lower() if category else "other")
        current += nbytes - old
        if current > peak:
            peak = current
            if categories is not None:
                at_peak = Counter()
                for nbytes, category in live.values():
                    at_peak[category] += nbytes
    return peak, dict(at_peak)
