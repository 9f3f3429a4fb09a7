"""harness/cost/tensor_peak.py `tracked`: a CPU trial's peak_memory_bytes is the peak of live
tensors in a steady step (as `harness bench memory` measures it), the process's RSS apart."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import estimated_peak, micro_run

from harness.bench.memory import PEAK_TOLERANCE, method_run
from harness.methods.resolve import load_run
from harness.train import train


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """A tiny full and LoRA run of the same model, 4 steps each (step 3 is the one measured)."""
    out = tmp_path_factory.mktemp("peak")
    runs = {label: method_run(label, "llama_tiny", 4, 64, 2, {"device": "cpu"})
            for label in ("full", "lora")}
    return {label: (run, train(run, out / label)) for label, run in runs.items()}


def test_a_cpu_trials_peak_is_its_live_tensors_within_5_percent_of_the_estimate(summaries):
    run, summary = summaries["full"]
    assert summary["status"] == "ok"
    assert abs(summary["peak_memory_bytes"] / estimated_peak(run) - 1) <= PEAK_TOLERANCE


def test_lora_peaks_below_full_and_rss_is_kept_apart(summaries):
    full, lora = summaries["full"][1], summaries["lora"][1]
    assert lora["peak_memory_bytes"] < full["peak_memory_bytes"]
    for summary in (full, lora):  # the process: the runtime, allocator slack, the data too
        assert summary["peak_rss_bytes"] > summary["peak_memory_bytes"] > summary["param_bytes"]


def test_the_peak_survives_a_resume_and_a_short_run_measures_its_last_step(tmp_path):
    run = load_run(micro_run(steps=5))
    first = train(run, tmp_path / "t", should_stop=lambda step: step == 3)
    assert first["status"] == "interrupted" and first["peak_memory_bytes"] > 0
    second = train(run, tmp_path / "t")  # 2 steps left: the checkpoint's peak is kept
    assert second["peak_memory_bytes"] == first["peak_memory_bytes"]
    short = train(load_run(micro_run(steps=1)), tmp_path / "one")
    assert short["peak_memory_bytes"] > short["param_bytes"]


def test_a_failing_timeline_leaves_the_trial_ok_without_a_live_tensor_peak(tmp_path, monkeypatch,
                                                                          capsys):
    """torch's memory-timeline analysis asserts on some graphs (seen under DDP with layer-wise
    hooks): the trial goes on, says so in one line, and keeps its RSS."""
    import harness.cost.tensor_peak as tensor_peak

    def broken(memory):
        raise AssertionError("version mismatch: {...}")

    monkeypatch.setattr(tensor_peak, "_peak", broken)
    summary = train(load_run(micro_run(steps=4)), tmp_path / "run")
    assert summary["status"] == "ok"
    assert summary.get("peak_memory_bytes") is None and summary["peak_rss_bytes"] > 0
    assert "peak of live tensors not recorded" in capsys.readouterr().out


TIMELINES = {  # label -> (method, --set overrides): graphs unlike each other's
    "full": ({"name": "full"}, {}),
    "lora bf16-true layer-wise": ({"name": "lora", "rank": 8},
                                  {"train.precision": "bf16-true", "memory.layerwise": True}),
    "galore 16-mixed recompute": ({"name": "galore", "rank": 8},
                                  {"train.precision": "16-mixed", "memory.recompute": "full"}),
    "adam8bit accumulation 2": ({"name": "adam8bit"}, {"train.total_batch_size": 8}),
    "qgalore": ({"name": "qgalore", "rank": 8}, {}),
    "apollo offloads": ({"name": "apollo", "rank": 8}, {"memory.offload": ["mlp"],
                                                       "memory.optimizer_offload": "host"}),
}
# The quick tier keeps the timelines of layer-wise, 16-mixed with recompute, and both offloads;
# the plain, accumulating and Q-GaLore ones run in the integration tier (tests/tiers.py).
QUICK = {"test_the_lean_timeline_peaks_where_torchs_whole_analysis_does": {
    (case,) for case in ("lora bf16-true layer-wise", "galore 16-mixed recompute",
                         "apollo offloads")}}


@pytest.mark.parametrize("case", TIMELINES)
def test_the_lean_timeline_peaks_where_torchs_whole_analysis_does(tmp_path, case):
    """`tracked` and `step_peak` read the allocator's events without torch's data-flow graph
    and categories, and record no Python stacks: torch's own MemoryProfile of the same recorded
    step (which needs the stacks) is the reference, to the byte, for the timeline read from
    either record (the second of a run trained again alike, by `step_peak`). Q-GaLore's peak is
    not the same from one run to the next (21,951,388 to 22,000,540 bytes over six runs, with
    stacks or without: 0.22%): its stackless record is held within 0.5% of the first."""
    from harness.cost.profile import profiler
    from harness.cost.tensor_peak import _peak, _timeline, step_peak
    from harness.train import Trainer
    from harness.trials import Records

    method, overrides = TIMELINES[case]
    run = load_run({**micro_run(steps=3), "method": method}, overrides)

    def trained(out: Path, measure: Callable[[Trainer], Any]) -> Any:
        trainer = Trainer(run, Records(out, run), lambda step: False)
        try:
            return measure(trainer)
        finally:
            trainer.close()

    def with_stacks(trainer: Trainer) -> torch.profiler.profile:
        with profiler(1, trainer.device, memory=True, stacks=True) as prof:
            trainer.hooks.on("step", lambda step: prof.step())
            trainer.fit()
        return prof

    whole = trained(tmp_path / "whole", with_stacks)
    lean, _ = trained(tmp_path / "lean", step_peak)
    reference = _peak(whole._memory_profile().timeline)[0]
    assert _peak(_timeline(whole))[0] == reference > 0
    if case == "qgalore":
        assert lean == pytest.approx(reference, rel=0.005)
    else:  # the same record read both ways is the same to the byte (above); two runs agree
        # but for a few small tensors live at one run's peak and not the other's: 1 byte (a bool
        # of harness/modifiers/precision.py's isfinite checks; galore 16-mixed recompute,
        # 24,942,184 against 24,942,185 bytes: 3 of 22 runs) and 60 bytes (lora bf16-true
        # layer-wise, 19,748,844 against 19,748,784, 3.0e-6: once in a CI run, after the worker's
        # earlier tests; 0 of 12 fresh runs). Bound 1e-5, over three times the largest seen and
        # far below the percents the peak is compared at (the estimate's 2%)
        assert lean == pytest.approx(reference, rel=1e-5, abs=0)


BEFORE_THE_FIRST_STEP = """
import json, sys
from pathlib import Path
from harness.methods.resolve import load_run
from harness.train import Trainer
from harness.trials import Records
run = load_run(json.loads(sys.argv[1]))
trainer = Trainer(run, Records(Path(sys.argv[2]), run), lambda step: False)
print(sorted(m for m in sys.modules if m.startswith("bitsandbytes"))[:1])
"""


def test_an_8bit_kernel_is_loaded_before_the_first_step(tmp_path):
    """A one-step run profiles its first step. Q-GaLore's 8-bit kernel once imported
    bitsandbytes there, in the step (the import sets up torch.compile: 1.9M profiler events,
    45 s of timeline analysis on 2 cores). A fresh process, as a trial is: no test has
    imported it already."""
    run = {**micro_run(steps=1), "method": {"name": "qgalore", "rank": 8}}
    done = subprocess.run([sys.executable, "-c", BEFORE_THE_FIRST_STEP, json.dumps(run),
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['bitsandbytes']"
