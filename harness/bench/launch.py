"""`harness bench launch`: what each launcher adds before a trial trains.

A sweep of one-step micro trials runs one at a time under each launcher; per trial, the
overhead is the time from its launch (launch.json) to its first training step (summary),
minus the model, method and optimizer build, which is the trial's own cost, not the
launcher's. Python start-up, imports and data setup are in it: a user pays them per trial.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.config.launchers import standalone_kinds
from harness.sweep.plan.expand import load_sweep
from harness.sweep.run.driver import run_sweep
from harness.trials import RunsDir, write_yaml

KINDS = standalone_kinds()  # the launchers that need no cluster


def bench_launch(trials: int) -> list[dict[str, Any]]:
    records = []
    for kind in KINDS:
        with tempfile.TemporaryDirectory() as tmp:
            seconds = _overheads(Path(tmp), kind, trials)
        records.append({"name": f"launch/{kind}", "value": statistics.median(seconds),
                        "unit": "s", "target": None, "per_trial": seconds})
    return records


def _overheads(tmp: Path, kind: str, trials: int) -> list[float]:
    sweep = {
        "name": "bench_launch", "model": "llama_micro",
        "task": {"seq_len": 32, "shuffle_buffer": 8},
        "train": {"steps": 1, "batch_size": 1, "log_every": 1},
        "eval": {"tokens": 32}, "methods": {"full": {}}, "seeds": list(range(trials)),
        "launcher": {"kind": kind, "jobs": 1},
    }  # fmt: skip
    source = tmp / "bench_launch.yaml"
    write_yaml(source, sweep)
    runs = RunsDir(tmp / "runs")
    with redirect_stdout(sys.stderr):  # the trials' progress; stdout is for the table or JSON
        run_sweep(load_sweep(source, {}), runs.path)
    seconds = []
    for trial in runs.trial_dirs():
        launched, summary = trial.read_launch(), trial.read_summary()
        if launched and summary and summary.get("first_step_at"):
            seconds.append(summary.get("first_step_at") - launched["submitted_at"]
                           - summary.get("build_s"))
    return seconds


def launch_table(records: list[dict[str, Any]]) -> str:
    rows = [[r["name"], f"{r['value']:.2f}", " ".join(f"{s:.2f}" for s in r["per_trial"])]
            for r in records]
    return tabulate(rows, headers=["launcher", "median s (launch → first step − build)",
                                   "per trial"])
