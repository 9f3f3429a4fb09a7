"""`harness sweep S --dry-run`: what the sweep will cost before a cluster is spent on it.

Per trial: the predicted peak a process holds (`harness estimate`), device-hours, and the disk
its checkpoints take; then the sweep's totals. Device-hours are the tokens over a tokens/s: the
median that finished trials of the same method measured in the runs folder, where it has them
(the same machine, the same model), else the plan's compute model on its stated device
(harness/cost/plan.py `DEVICE`: an H100 at 400 TFLOP/s bf16), times the processes a trial
uses. A checkpoint holds the weights, the optimizer states and the method's extras (GaLore's
bases, quantization constants), each at the run's widths; of the checkpoints a trial writes
(every `train.checkpoint_every` steps and at the end), `train.keep_checkpoints` stay.
Pretraining only: a GLUE sweep's model is measured by running it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from harness.config import SweepConfig, TrainConfig
from harness.cost.estimate import estimate_run, human_bytes
from harness.cost.plan import DEVICE, step_work
from harness.sweep.expand import Trial
from harness.trials import RunsDir, Status


def measured_rates(out: Path) -> dict[str, float]:
    """Each method label's median tokens/s over the finished trials in `out`."""
    rates: dict[str, list[float]] = {}
    if not RunsDir(out).is_runs_dir():
        return {}
    for trial_dir in RunsDir(out).trial_dirs():
        summary = trial_dir.read_summary()
        s = summary.to_dict() if summary is not None else {}
        if s.get("status") == Status.OK and s.get("tokens_per_s"):
            rates.setdefault(str(s["method"]), []).append(float(s["tokens_per_s"]))
    return {label: statistics.median(v) for label, v in rates.items()}


def forecast(sweep: SweepConfig, trials: list[Trial], out: Path) -> list[dict[str, Any]]:
    """One record per trial: peak bytes, device-hours (and where the speed came from), disk."""
    ranks = sweep.launcher.ranks
    rates = measured_rates(out)
    records = []
    for t in trials:
        estimate = estimate_run(t.run, ranks)
        if t.label in rates:
            hours, source = t.tokens / rates[t.label] / 3600 * ranks, "measured"
        else:
            per_step = step_work(t.run, ranks)[2]  # one GPU's seconds a step
            hours, source = per_step * t.run.train.steps / 3600 * ranks, "model"
        state = (estimate["weight_bytes"] + estimate["optimizer_state_bytes"]
                 + estimate["extra_bytes"]) * (ranks if t.run.train.parallel == "fsdp" else 1)
        records.append({"trial": t.id, "method": t.label, "peak_bytes": estimate["peak_bytes"],
                        "device_hours": hours, "speed": source,
                        "disk_bytes": state * kept_checkpoints(t.run.train)})
    return records


def kept_checkpoints(train: TrainConfig) -> int:
    """Checkpoints a finished trial keeps: one every `checkpoint_every` steps and one at the
    end (the last of them when the steps are a multiple), the newest `keep_checkpoints`."""
    written = -(-train.steps // train.checkpoint_every) if train.checkpoint_every else 1
    return min(written, train.keep_checkpoints)


def device_time(hours: float) -> str:
    """Hours where there are some; minutes or seconds for a small sweep's trials."""
    if hours >= 1:
        return f"{hours:,.1f} h"
    return f"{hours * 60:.1f} min" if hours * 60 >= 1 else f"{hours * 3600:.1f} s"


def forecast_columns(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The plan table's extra columns: header -> a cell per trial."""
    return {
        "peak a process": [human_bytes(r["peak_bytes"]) for r in records],
        "device time": [device_time(r["device_hours"])
                        + (" (measured)" if r["speed"] == "measured" else "") for r in records],
        "checkpoints": [human_bytes(r["disk_bytes"]) for r in records],
    }


def forecast_totals(records: list[dict[str, Any]], tokens: int) -> str:
    hours = sum(r["device_hours"] for r in records)
    disk = sum(r["disk_bytes"] for r in records)
    modelled = sum(r["speed"] == "model" for r in records)
    device = (f"{modelled} of them on the plan's compute model: an H100 at "
              f"{DEVICE.bf16_flops / 1e12:.0f} TFLOP/s bf16, {DEVICE.fp32_flops / 1e12:.0f} fp32"
              if modelled else "all from tokens/s measured in the runs folder")
    return (f"{len(records)} trials, {tokens:,} tokens in all; predicted: "
            f"{device_time(hours)} of device time ({device}); {human_bytes(disk)} of "
            f"checkpoints; the largest peak {human_bytes(max(r['peak_bytes'] for r in records))} "
            "a process")
