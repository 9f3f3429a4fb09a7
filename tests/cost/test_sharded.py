"""A rank's peak under fsdp (harness/cost/sharded.py) against each rank's measured peak of live
tensors in 2- and 4-process CPU runs (tests/cost/fsdp_peaks.py: torch's FSDPMemTracker, or the
profiler's memory timeline with accumulation), every method fsdp accepts.

Measured (llama_micro, fp32): the estimate is within 0.93% of every rank's peak
(8-bit Adam on 4: +0.22%; the accumulating runs, profiled: -0.01% to -0.93% reducing every
micro-batch, -0.02% the last only, which held 0.95 MB more; full, LoRA, low-rank, ReLoRA,
GaLore, Fira, Adam-mini, APOLLO and APOLLO-Mini within 700 bytes); ranks agree to the byte under
FSDPMemTracker. TOLERANCE 2% holds that with room for buffers another torch version keeps a
moment longer (the issue's bound is 5%). The profiler's timeline, outside these tests, saw
some ranks up to 2.7% above the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import free_port, micro_run, write_yaml
from ranks import Ranks

from harness.cost.estimate import estimate_run
from harness.methods.resolve import load_run

METHODS = {"full": {"name": "full"}, "lora": {"name": "lora", "rank": 4},
           "lowrank": {"name": "lowrank", "rank": 8},
           "galore": {"name": "galore", "rank": 8, "update_proj_gap": 3},
           "adam_mini": {"name": "adam_mini"},
           "relora": {"name": "relora", "rank": 4, "reset_every": 2, "restart_warmup_steps": 1},
           "apollo": {"name": "apollo", "rank": 8, "update_proj_gap": 3},
           "apollo_mini": {"name": "apollo_mini", "update_proj_gap": 3},
           "fira": {"name": "fira", "rank": 8, "update_proj_gap": 3},
           "adam8bit": {"name": "adam8bit", "min_8bit_size": 256},
           "muon": {"name": "muon"}}  # fmt: skip
# 8-bit GaLore's right-side moments by rows must be whole 256-value blocks: (176, 32) is 11
# blocks a rank on 2, 5.5 on 4 (refused there: tests/train/test_fsdp.py)
GALORE_8BIT = {"name": "galore", "rank": 32, "update_proj_gap": 3, "optimizer": "adam8bit",
               "min_8bit_size": 256}
TOLERANCE = 0.02


def configs(tmp_path: Path, world: int) -> dict[Path, dict]:
    """Each method on one micro-batch of 2 a rank; on 2 ranks also full AdamW accumulating 2."""
    runs = {f"{name}-{world}": {**micro_run(total_batch_size=2 * world, parallel="fsdp"),
                                "method": method} for name, method in METHODS.items()}
    if world == 2:  # accumulating: shards reduced every micro-batch (the default), or whole
        runs["full-2-accumulating"] = micro_run(total_batch_size=8, parallel="fsdp")
        runs["full-2-accumulating-last"] = micro_run(total_batch_size=8, parallel="fsdp",
                                                     fsdp_reduce="last")
        runs["galore_8bit-2"] = {**micro_run(total_batch_size=4, parallel="fsdp"),
                                 "method": GALORE_8BIT}
    return {write_yaml(tmp_path / f"{label}.yaml", data): data for label, data in runs.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_each_ranks_peak_is_the_estimate_within_2_percent(tmp_path, world):
    runs = configs(tmp_path, world)
    done = Ranks([str(tmp_path), *map(str, runs)], world, free_port(), "fsdp_peaks")
    log, _ = done.communicate(timeout=600)
    assert done.returncode == 0, log
    measured = [json.loads(line) for p in tmp_path.glob("rank-*.jsonl")
                for line in p.read_text().splitlines()]
    assert len(measured) == world * len(runs)
    rows = []
    for path, data in runs.items():
        record = estimate_run(load_run(data), world)
        # less the cuBLAS workspaces a CUDA rank would hold (the estimate's device is a GPU
        # unless `device: cpu`); these ranks run on the CPU
        estimate = record["peak_bytes"] - record["workspace_bytes"]
        peaks = [m["peak"] for m in measured if m["config"] == str(path)]
        rows.append(f"{path.stem}: estimate {estimate:,}, ranks {peaks}")
        assert all(abs(peak / estimate - 1) <= TOLERANCE for peak in peaks), rows[-1]
    print("\n".join(rows))
    if world == 2:  # reduced each micro-batch, a rank holds shards, not whole gradients
        peak = {p.stem: max(m["peak"] for m in measured if m["config"] == str(p)) for p in runs}
        assert peak["full-2-accumulating"] < peak["full-2-accumulating-last"]
