"""The metric registry: every measured value of a trial, with its unit, column header, cell
format, direction and how seeds are folded. The summary's fields, the search objectives and
constraints, `harness status` (table and --json), the report's tables and Pareto fronts all read
this one list; adding a metric is its entry here plus the code that measures it.

It lives in harness.config, plain data importing nothing of the harness, because the config
is its lowest reader: `search.objectives` and `search.constraints` are validated against its
names when a sweep file loads, and every room above (trials' Summary, analysis) may import
the config, never the other way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Direction = Literal["minimize", "maximize"]
Fold = Literal["mean", "max", "min"]
Line = Literal["train", "eval"]
BYTES = "bytes"  # a cell format: decimal units, 1 GB = 10^9 bytes (human_bytes below)


@dataclass(frozen=True)
class Metric:
    """One measured value. `name` is its key in summary.json (and in metrics.jsonl's lines
    of kind `live`); `spec` a format spec for a table cell, or BYTES; `across_seeds` how the
    report folds a configuration's seeds into one number."""

    name: str
    header: str
    unit: str
    spec: str
    direction: Direction = "minimize"
    across_seeds: Fold = "mean"
    objective: bool = False  # may be a search objective or constraint
    status: bool = False  # a column of `harness status` (table and --json)
    report: bool = False  # a column of the report's methods table
    at_start: bool = False  # null in summary.json from the trial's start
    live: Line | None = None  # logged as it trains, in metrics.jsonl lines of this kind
    field: bool = True  # every summary has it (else only some tasks: GLUE's score)
    derived: tuple[str, float] | None = None  # (summary key, factor): computed from another
    missing: str = ""  # a cell with no value


REGISTRY: tuple[Metric, ...] = (
    Metric("last_loss", "loss", "", ".4f", status=True),  # the last logged training loss
    Metric("eval_loss", "eval loss", "nats/token", ".2f", objective=True, at_start=True,
           live="eval"),
    Metric("eval_ppl", "eval ppl", "", ".2f", objective=True, status=True, report=True,
           at_start=True, live="eval"),
    Metric("eval_score", "score", "", ".2f", direction="maximize", objective=True,
           live="eval", field=False),  # a GLUE task's main metric
    Metric("tokens_per_s", "tok/s", "tokens/s", ",.0f", direction="maximize", objective=True,
           status=True, report=True, at_start=True, live="train"),
    Metric("grad_norm", "grad norm", "", ".3g", objective=True, status=True, report=True,
           live="train"),  # before clipping, the mean over logged steps; layer-wise: none
    Metric("mfu", "MFU", "", ".1%", direction="maximize", at_start=True),
    Metric("compile_s", "compile s", "s", ",.1f", field=False),  # train.compile's first step
    Metric("peak_memory_bytes", "peak memory", "bytes", BYTES, across_seeds="max",
           objective=True, status=True, report=True, at_start=True),  # live tensors
    Metric("peak_rss_bytes", "peak RSS", "bytes", BYTES, across_seeds="max", status=True,
           report=True, at_start=True),  # the trial process's peak resident set
    Metric("param_bytes", "weights", "bytes", BYTES, across_seeds="max", at_start=True),
    Metric("grad_bytes", "gradients", "bytes", BYTES, across_seeds="max", at_start=True),
    Metric("optimizer_state_bytes", "optimizer state", "bytes", BYTES, across_seeds="max",
           report=True, at_start=True),
    Metric("trainable_params", "trainable params", "parameters", ",.0f", across_seeds="max",
           at_start=True),
    Metric("total_params", "params", "parameters", ",.0f", across_seeds="max"),
    Metric("wall_s", "wall s", "s", ",.0f", at_start=True),  # summed over resumes
    Metric("trial_hours", "trial-hours", "hours", ".3f", objective=True, field=False,
           derived=("wall_s", 1 / 3600)),
    Metric("requeues", "requeues", "", ".0f", across_seeds="max", status=True, missing="0"),
    Metric("final_model_bytes", "final model", "bytes", BYTES, across_seeds="max",
           status=True),  # train.keep_final's files
    Metric("extra_bytes", "extra", "bytes", BYTES, across_seeds="max"),  # projections, ...
    Metric("skipped_steps", "skipped steps", "steps", ".0f", across_seeds="max"),  # fp16
    Metric("offloaded_bytes_per_step", "offloaded per step", "bytes", BYTES),
)  # fmt: skip
METRICS: dict[str, Metric] = {m.name: m for m in REGISTRY}
OBJECTIVES: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.objective)
EVALUATED: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.live == "eval")  # each eval
STATUS: tuple[str, ...] = tuple(m.name for m in REGISTRY if m.status)


def human_bytes(value: Any) -> str:
    """Decimal units (GB = 1e9 bytes) to match how accelerator memory is usually quoted."""
    import pandas as pd  # here: a worker or trial process that never prints a table skips it

    if pd.isna(value):
        return ""
    if value >= 1e9:
        return f"{value / 1e9:.2f} GB"
    if value >= 1e6:
        return f"{value / 1e6:.1f} MB"
    if value >= 1e3:
        return f"{value / 1e3:.1f} kB"
    return f"{value:.0f} B"
