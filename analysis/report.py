"""Turn loaded runs into the tables and plot that a sweep is judged by.

Each method is compared at its own best learning rate (lowest final eval perplexity among
trials that finished), the protocol of the papers this harness compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.records import atomic_write

from .load import PathArg, load_runs, load_steps, read_sweep
from .plots import curves_plot, memory_chart, save_png

SUMMARY_COLUMNS = (
    "method", "memory", "precision", "best lr", "eval ppl", "tok/s", "peak memory",
    "optimizer state", "trials",
)  # fmt: skip
VARIANT = ["method", "memory", "precision"]  # what a row of the summary compares
VARIANT_DEFAULTS = {"method": "unknown", "memory": "none", "precision": "fp32"}
MEMORY_NOTE = "Memory columns use decimal units: 1 MB = 10^6 bytes, 1 GB = 10^9 bytes."


def summary_table(trials: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """One row per method and memory modifiers at its best LR; methods named in `order`
    (sweep.yaml) come first, each one's modifier variants in the order they appear."""
    trials = trials.assign(**{k: trials[k].fillna(d) for k, d in VARIANT_DEFAULTS.items()})
    rows = []
    for label in _ordered(trials["method"].astype(str), order):
        own = trials[trials["method"].astype(str) == label]
        for key, group in own.groupby(VARIANT, sort=False):
            rows.append(_method_row(dict(zip(VARIANT, key, strict=True)), group))
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def status_table(trials: pd.DataFrame) -> str:
    """Per-trial progress for `harness status`, readable while a sweep is still running."""
    table = pd.DataFrame(
        {
            "id": trials["trial"],
            "method": trials["method"],
            "memory": trials["memory"].fillna("none"),
            "status": trials["status"],
            "step": [
                f"{_int(step, '0')}/{_int(steps, '?')}"
                for step, steps in zip(trials["step"], trials["steps"], strict=True)
            ],
            "loss": trials["last_loss"].map(_loss),
            "eval ppl": trials["eval_ppl"].map(_ppl),
            "tok/s": trials["tokens_per_s"].map(_rate),
            "peak memory": trials["peak_memory_bytes"].map(human_bytes),
            "requeues": trials["requeues"].map(lambda v: _int(v, "0")),
        }
    )
    return text_table(table)


def write_report(runs_dir: PathArg) -> str:
    """Write report/{trials.csv,summary.md,loss.png} (and glue.{md,csv} for GLUE trials) and
    return the summary for the terminal."""
    from .glue import GLUE_NOTE, GLUE_TITLE, write_glue  # glue.py imports this module

    runs_dir = Path(runs_dir)
    trials = load_runs(runs_dir)
    sweep = read_sweep(runs_dir)
    name = str(sweep.get("name") or runs_dir.resolve().name)
    order = _sweep_methods(sweep)
    kinds = trials["task.kind"].fillna("pretrain") if "task.kind" in trials else None
    pretraining = trials if kinds is None else trials[kinds != "glue"]
    table = summary_table(pretraining, order=order)
    out = runs_dir / "report"
    out.mkdir(exist_ok=True)
    atomic_write(out / "trials.csv", trials.to_csv(index=False))
    caption = save_png(*curves_plot(load_steps(runs_dir), trials, name), out / "loss.png")
    memory = save_png(*memory_chart(trials, name), out / "memory.png")
    glue = write_glue(trials, order, out)
    pretrain = [text_table(table), best_lr_line(table)] if not (glue and pretraining.empty) else []
    sections = [
        f"# Sweep report: {name}",
        MEMORY_NOTE,
        *pretrain,
        f"![{caption}](loss.png)",
        f"![{memory}](memory.png)",
        "All trials, all columns: `trials.csv`.",
    ]
    if glue:
        sections += [f"## {GLUE_TITLE}", GLUE_NOTE, glue]
    atomic_write(out / "summary.md", "\n\n".join(sections) + "\n")
    return "\n\n".join([*pretrain[:1], *([f"{GLUE_TITLE}\n{glue}"] if glue else [])])


def best_lr_line(table: pd.DataFrame) -> str:
    """Say which LR won per method, so a reader need not scan the table."""
    picks = []
    for method, memory, precision, lr in table[[*VARIANT, "best lr"]].itertuples(index=False):
        extra = [x for x, d in ((memory, "none"), (precision, "fp32")) if x != d]
        name = f"{method} ({', '.join(extra)})" if extra else method
        picks.append(f"{name} {lr or 'n/a'}")
    return "Best LR per method: " + ", ".join(picks)


def human_bytes(value: Any) -> str:
    """Decimal units (GB = 1e9 bytes) to match how accelerator memory is usually quoted."""
    if pd.isna(value):
        return ""
    if value >= 1e9:
        return f"{value / 1e9:.2f} GB"
    if value >= 1e6:
        return f"{value / 1e6:.1f} MB"
    if value >= 1e3:
        return f"{value / 1e3:.1f} kB"
    return f"{value:.0f} B"


def text_table(table: pd.DataFrame) -> str:
    """Markdown (github) table; numbers are pre-formatted, so tabulate must not re-parse them."""
    return table.fillna("").to_markdown(index=False, disable_numparse=True)


def _method_row(variant: dict[str, str], group: pd.DataFrame) -> dict[str, str]:
    """Best LR by mean eval ppl over seeds, among ok trials; blanks if none finished."""
    row = dict.fromkeys(SUMMARY_COLUMNS, "")
    row.update(variant, trials=_status_counts(group["status"]))
    ok = group[(group["status"] == "ok") & group["eval_ppl"].notna() & group["lr"].notna()]
    if ok.empty:
        return row
    by_lr = ok.groupby("lr").agg(
        ppl=("eval_ppl", "mean"),
        rate=("tokens_per_s", "mean"),
        peak=("peak_memory_bytes", "max"),
        state=("optimizer_state_bytes", "max"),
    )
    best_lr = by_lr["ppl"].idxmin()
    best = by_lr.loc[best_lr]
    row.update(
        {
            "best lr": f"{best_lr:g}",
            "eval ppl": _ppl(best["ppl"]),
            "tok/s": _rate(best["rate"]),
            "peak memory": human_bytes(best["peak"]),
            "optimizer state": human_bytes(best["state"]),
        }
    )
    return row


def _status_counts(status: pd.Series) -> str:
    """E.g. "1 ok / 3 (1 failed, 1 pending)": why a method has fewer results than planned."""
    counts = status.fillna("unknown").value_counts().sort_index()
    others = ", ".join(f"{n} {s}" for s, n in counts.items() if s != "ok")
    text = f"{int(counts.get('ok', 0))} ok / {len(status)}"
    return f"{text} ({others})" if others else text


def _ordered(labels: pd.Series, order: Sequence[str]) -> list[str]:
    """Sweep order first (how the author listed methods), the rest alphabetically."""
    present = set(labels)
    return [m for m in order if m in present] + sorted(present - set(order))


def _sweep_methods(sweep: dict[str, Any]) -> list[str]:
    methods = sweep.get("methods")
    return [str(label) for label in methods] if isinstance(methods, dict) else []


def _int(value: Any, missing: str) -> str:
    return missing if pd.isna(value) else str(int(value))


def _loss(value: Any) -> str:
    return "" if pd.isna(value) else f"{value:.4f}"


def _ppl(value: Any) -> str:
    return "" if pd.isna(value) else f"{value:.2f}"


def _rate(value: Any) -> str:
    return "" if pd.isna(value) else f"{value:,.0f}"
