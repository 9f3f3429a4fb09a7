"""The peak of live tensor bytes in a steady training step: `torch.cuda.max_memory_allocated`
on a GPU, and on the CPU, which keeps no allocator statistics, the profiler's memory timeline
of one step. `harness bench memory` checks the activation model against it, and `tracked`
records it as a CPU trial's `peak_memory_bytes`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.profiler._memory_profiler import (
    Action,
    CategoryDict,
    DataFlowGraph,
    MemoryProfile,
    OpTree,
    SizeMap,
)

from harness.cost.profile import SKIPPED, profiler
from harness.distributed import every_rank, say
from harness.errors import brief

PEAK = "peak_memory_bytes"
BY_RANK = "peak_memory_bytes_by_rank"  # fsdp ranks hold different shares: each one's peak

if TYPE_CHECKING:
    from harness.train import Trainer
    from harness.train.hooks import Step


def step_peak(trainer: Trainer) -> tuple[int, dict[str, int]]:
    """Run `trainer.fit()` (more than SKIPPED steps) and return the peak after the first SKIPPED
    steps, with its breakdown by the profiler's categories (parameter, activation, ...) on CPU."""
    if trainer.run.train.steps <= SKIPPED:
        raise ValueError(f"step_peak needs more than {SKIPPED} steps")
    if trainer.device.type == "cuda":
        def reset(step: Step) -> None:
            if step.number == SKIPPED:
                torch.cuda.reset_peak_memory_stats(trainer.device)

        trainer.hooks.on("step", reset)
        trainer.fit()
        return torch.cuda.max_memory_allocated(trainer.device), {}
    with profiler(1, trainer.device, memory=True) as prof:
        trainer.hooks.on("step", lambda step: prof.step())
        trainer.fit()
    return _peak(prof._memory_profile())


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
            peak = _peak(_uncategorized(prof))[0]
            trainer.costs[PEAK] = peak
        except Exception as e:  # torch's timeline analysis asserts on some graphs (seen under
            # DDP with layer-wise hooks): a measurement must never end the trial it measures
            say(f"peak of live tensors not recorded: torch's memory timeline failed "
                f"({brief(e)}); the summary keeps peak_rss_bytes")
        finally:
            peaks = every_rank(peak)  # every rank profiles the same step: in lockstep
            if trainer.sharded and all(peaks):
                trainer.costs[BY_RANK] = peaks
            trainer.meter.resume()

    with profiler(1, trainer.device, memory=True, on_trace_ready=ready,
                  skipped=min(SKIPPED, left - 1)) as prof:
        trainer.hooks.on("step", lambda step: prof.step())
        yield


def _uncategorized(prof: torch.profiler.profile) -> MemoryProfile:
    """torch's memory timeline without the tensor categories, which only a breakdown needs: the
    same peak (tests/cost/test_tensor_peak.py) from about half the analysis that every CPU trial
    pays (0.36 s instead of 0.66 s at llama_micro on 2 cores)."""
    memory = MemoryProfile.__new__(MemoryProfile)  # __init__ runs the categories' seven passes
    memory._op_tree = OpTree(prof.profiler.kineto_results)  # type: ignore[union-attr]
    memory._data_flow_graph = DataFlowGraph(memory._op_tree)
    memory._size_map = SizeMap(memory._op_tree)
    memory._categories = CategoryDict()
    return memory


def _peak(memory: object) -> tuple[int, dict[str, int]]:
    live: dict[object, tuple[int, str]] = {}
    current = peak = 0
    at_peak: Counter[str] = Counter()
    for _, action, (key, version), size in memory.timeline:  # type: ignore[attr-defined]
        if action == Action.DESTROY:
            current -= live.pop(key, (0, ""))[0]
            continue
        bumped = action == Action.INCREMENT_VERSION  # written in place: same bytes, maybe a new
        old = live.get(key, (0, ""))[0]  # category (a gradient becoming an optimizer state)
        nbytes = old if bumped and old else size
        category = memory._categories.get(key, version + bumped)  # type: ignore[attr-defined]
        live[key] = (nbytes, category.name.lower() if category else "other")
        current += nbytes - old
        if current > peak:
            peak = current
            at_peak = Counter()
            for nbytes, category in live.values():
                at_peak[category] += nbytes
    return peak, dict(at_peak)
