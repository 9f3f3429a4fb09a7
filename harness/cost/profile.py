"""`harness train --profile N`: a torch.profiler trace of N training steps, to see where the
time goes before changing anything.

Step 1 (allocation, lazy init) and step 2 (profiler warm-up) are not recorded; steps 3…N+2 are.
The trial folder gets `profile/trace.json` (open in https://ui.perfetto.dev or
chrome://tracing) and `profile/ops.txt`, the operators by self time (device time on CUDA).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity, profile, schedule

if TYPE_CHECKING:
    from harness.train import Trainer

SKIPPED = 2  # steps before the recorded ones


def profiler(steps: int, device: torch.device, memory: bool = False, stacks: bool = False,
             on_trace_ready: Callable[[profile], None] | None = None,
             skipped: int = SKIPPED) -> profile:
    """`memory`: also record allocations, for the memory timeline (harness/cost/tensor_peak.py);
    `stacks`: and the Python stacks, which torch's memory categories need (a breakdown), not
    the peak (they cost about 0.2 s of a llama_micro trial's 1.4 s on 2 cores); `on_trace_ready`
    runs as soon as the recorded steps end; `skipped`: steps before them (the last one a
    warm-up)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with warnings.catch_warnings():  # no step to warm up on (a 1-step run): torch says so
        warnings.simplefilter("ignore")
        steps_of = schedule(wait=max(skipped - 1, 0), warmup=min(skipped, 1), active=steps,
                            repeat=1)
    return profile(activities=activities, record_shapes=True, profile_memory=memory,
                   with_stack=stacks, on_trace_ready=on_trace_ready, schedule=steps_of)


def write(prof: profile, out: Path, device: torch.device, rows: int = 30) -> str:
    """Write the trace and the operator table; returns the table's first `rows` rows."""
    folder = out / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / "trace.json"))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    (folder / "ops.txt").write_text(averages.table(sort_by=key, row_limit=200) + "\n")
    return averages.table(sort_by=key, row_limit=rows)


@contextmanager
def profiled(trainer: Trainer, steps: int, out: Path) -> Iterator[None]:
    """Trace `steps` steps of `trainer.fit()` run inside this block (none when 0); a run that
    ends sooner is traced up to its end."""
    if not steps:
        yield
        return
    with profiler(steps, trainer.device) as prof:
        trainer.hooks.on("step", lambda step: prof.step())  # a step's boundary in the trace
        yield
    print(write(prof, out, trainer.device), flush=True)
    print(f"profile of {steps} steps: {out / 'profile'} (trace.json, ops.txt)", flush=True)
