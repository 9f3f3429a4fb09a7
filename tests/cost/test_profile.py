"""harness/cost/profile.py: the schedule skips the first steps and records the next ones, and
`write` leaves a trace and an operator table in the trial folder."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cost.profile import SKIPPED, profiler, write

CPU = torch.device("cpu")


def work(prof, steps: int) -> None:
    a = torch.randn(32, 32)
    for _ in range(steps):
        (a @ a).relu_()
        prof.step()


def test_records_the_steps_after_the_skipped_ones_and_writes_both_files(tmp_path):
    with profiler(2, CPU) as prof:
        work(prof, SKIPPED + 3)  # one step more than recorded: outside the window
    table = write(prof, tmp_path, CPU, rows=5)
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep")}
    assert steps == {f"ProfilerStep#{SKIPPED}", f"ProfilerStep#{SKIPPED + 1}"}
    ops = (tmp_path / "profile" / "ops.txt").read_text()
    assert "aten::mm" in ops and "aten::relu_" in ops and "Self CPU" in ops
    assert "aten::mm" in table and len(table.splitlines()) < len(ops.splitlines())


@pytest.mark.parametrize("stacks", [False, True])
def test_memory_mode_records_allocations_with_shapes(stacks):
    with profiler(1, CPU, memory=True, stacks=stacks) as prof:
        work(prof, SKIPPED + 1)
    assert prof.profile_memory and prof.record_shapes and prof.with_stack is stacks
    mm = [e for e in prof.events() if e.name == "aten::mm"]
    assert mm and mm[0].input_shapes[:2] == [[32, 32], [32, 32]]
    assert max(e.cpu_memory_usage for e in prof.events()) >= 32 * 32 * 4
    # the Python tracer's frames ("file.py(line): function") only when asked
    assert any(".py(" in e.name for e in prof.events()) is stacks
