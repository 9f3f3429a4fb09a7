"""`harness sweep S --dry-run`: what the sweep will cost before a cluster is spent on it, and
the disk check before its first trial.

Per trial: the predicted peak a process holds (`harness estimate`), device-hours, and the disk
its checkpoints take; then the sweep's totals. Device-hours are the tokens over a tokens/s: the
median that finished trials of the same method measured in the runs folder, where it has them
(the same machine, the same model), else the plan's compute model on its stated device
(harness/cost/plan.py `DEVICE`: an H100 at 400 TFLOP/s bf16), times the processes a trial
uses. Disk (harness/cost/disk.py): what a trial keeps once it ends (its final model, and its
checkpoints under `train.keep_final: full`), and the most the sweep needs at once.
The forecast is pretraining's: a GLUE sweep's model is measured by running it.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from harness.config import LauncherConfig, SweepConfig
from harness.config.metrics import human_bytes
from harness.cost.disk import disk_needed, free_bytes
from harness.cost.estimate import estimate_run
from harness.cost.plan import DEVICE, step_work
from harness.errors import UserError
from harness.sweep.plan.expand import Trial, plan_table
from harness.sweep.run.keep import Group, key_of
from harness.trials import RunsDir, Status
from harness.trials.writable import check_writable

DISK_FIELDS = ("checkpoints_bytes", "final_model_bytes", "disk_peak_bytes", "disk_kept_bytes")


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
        estimate = estimate_run(t.run, ranks, local=sweep.launcher.tasks_per_node)
        if t.label in rates:
            hours, source = t.tokens / rates[t.label] / 3600 * ranks, "measured"
        else:
            per_step = step_work(t.run, ranks)[2]  # one GPU's seconds a step
            hours, source = per_step * t.run.train.steps / 3600 * ranks, "model"
        disk = {k: estimate[k] for k in DISK_FIELDS}
        records.append({"trial": t.id, "method": t.label, "peak_bytes": estimate["peak_bytes"],
                        "device_hours": hours, "speed": source, **disk})
    return records


def plan_text(sweep: SweepConfig, trials: list[Trial], out: Path) -> str:
    """The dry-run's view of a grid's `trials`: a row each and their count; for pretraining,
    what each will cost (peak, device time, disk) and the sweep's totals."""
    if sweep.task.kind != "pretrain":  # a GLUE model is measured by running it
        return f"{plan_table(trials)}\n{len(trials)} trials"
    tokens = sum(t.tokens for t in trials if not t.run.train.epochs)
    records = forecast(sweep, trials, out)
    after = kept_after(sweep, trials, records)
    return (f"{plan_table(trials, forecast_columns(records))}\n"
            f"{forecast_totals(records, tokens, sweep.launcher.at_once, after)}")


def kept_after(sweep: SweepConfig, trials: list[Trial], records: list[dict[str, Any]]
               ) -> tuple[str, int] | None:
    """The sweep's `keep_models` and the bytes its trials keep once it has dropped their final
    models (best: one per method, model and budget, the largest); None where it drops none."""
    models = [r["final_model_bytes"] for r in records]
    rest = sum(r["disk_kept_bytes"] for r in records) - sum(models)
    if sweep.keep_models == "all":
        return None
    kept: dict[Group, int] = {}
    if sweep.keep_models == "best":
        for t, model in zip(trials, models, strict=True):
            key = key_of(t.label, t.run.model_dump(by_alias=True))
            kept[key] = max(kept.get(key, 0), model)
    after = rest + sum(kept.values())
    return (sweep.keep_models, after) if after < rest + sum(models) else None


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
        "kept on disk": [human_bytes(r["disk_kept_bytes"]) for r in records],
    }


def forecast_totals(records: list[dict[str, Any]], tokens: int, at_once: int,
                    after: tuple[str, int] | None = None) -> str:
    """The sweep's totals; `at_once`: the trials its launcher runs together; `after`: the
    sweep's keep_models and what stays once it has dropped final models (kept_after)."""
    hours = sum(r["device_hours"] for r in records)
    kept, needed = sum(r["disk_kept_bytes"] for r in records), disk_needed(records, at_once)
    dropped = (f"{human_bytes(after[1])} kept on disk once keep_models: {after[0]} has "
               f"dropped final models ({human_bytes(kept)} as the trials end, "
               if after else f"{human_bytes(kept)} kept on disk (")
    modelled = sum(r["speed"] == "model" for r in records)
    device = (f"{modelled} of them on the plan's compute model: an H100 at "
              f"{DEVICE.bf16_flops / 1e12:.0f} TFLOP/s bf16, {DEVICE.fp32_flops / 1e12:.0f} fp32"
              if modelled else "all from tokens/s measured in the runs folder")
    largest = human_bytes(max(r["peak_bytes"] for r in records))
    trials = f"{len(records)} trial{'s' if len(records) != 1 else ''}"
    return (f"{trials}, {tokens:,} tokens in all; predicted: {device_time(hours)} of device "
            f"time ({device}); {dropped}{human_bytes(needed)} at most "
            f"while {at_once} run at once); the largest peak {largest} a process")


def check_disk(launcher: LauncherConfig, left: list[Trial], out: Path) -> None:
    """Refuse, before the first trial starts, a sweep whose trials `left` to run cannot fit
    the runs folder's file system: what each keeps once ended, plus what the trials running
    at once hold beyond that (harness/cost/disk.py). A folder it cannot write is refused for
    that (its free bytes are not the cause)."""
    check_writable(out)
    if not left:
        return
    ranks, at_once = launcher.ranks, launcher.at_once
    local = launcher.tasks_per_node  # a search repeats its trials: one estimate each
    estimates = {t.id: estimate_run(t.run, ranks, local=local) for t in left}
    records = [estimates[t.id] for t in left]
    needed, free = disk_needed(records, at_once), free_bytes(out)
    if needed > free:
        raise UserError(
            f"disk: the {len(left)} trials left to run need {human_bytes(needed)} in {out} "
            f"(their final models and kept checkpoints, and {at_once} at once while they run) "
            f"but its file system has {human_bytes(free)} free; free some, set "
            "train.keep_final: weights or none, lower train.keep_checkpoints, or give --out on "
            "another disk")
