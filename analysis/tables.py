"""Result tables in the published papers' formats, so a sweep reads next to the paper.

Every function returns formatted strings (ready for CSV and Markdown); `write_tables` writes
each non-empty one as <slug>.csv and <slug>.md. Each row is a method label of the sweep at its
own best LR (lowest seed-mean eval perplexity, `stats.best_lr`); a label run with several
memory modifiers or precisions gets one row per variant, named by what differs.
This module imports nothing from report.py, so report.py may import it at the top.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from harness.config.metrics import METRICS
from harness.trials import atomic_write

from .anchors import compare_anchors
from .caveats import SHARED, shared
from .format import cell, text_table
from .glue import GLUE_NOTE, GLUE_TITLE, glue_table, has_glue
from .paper import (
    SIZES,
    compare_glue,
    compare_pretrain,
    compare_throughput,
    layerwise,
    task_kind,
    variants,
)
from .stats import at_best, best_lr, format_ci
from .unreadable import mark_methods

MODEL_ORDER = ("llama_micro", "llama_tiny", "llama_60m", "llama_130m", "llama_350m",
               "llama_1b", "llama_7b")  # fmt: skip
ROW = ["method", "memory", "precision"]
THROUGHPUT_COLUMNS = ["memory", "tok/s", "memory (layer-wise)", "tok/s (layer-wise)"]
PRETRAIN_TITLE = "Pretraining (GaLore Table 2 format)"
PRETRAIN_NOTE = (
    "Each cell: eval perplexity at the method's best LR for that model (lowest mean over "
    "seeds; mean ± 95% CI, Student's t, where several seeds finished), then in parentheses "
    "the highest peak memory of those trials (1 GB = 10^9 bytes)."
)
THROUGHPUT_TITLE = "Throughput (GaLore Table 11 format)"
THROUGHPUT_NOTE = (
    "At each method's best LR: highest peak memory (1 GB = 10^9 bytes) and mean training "
    "tokens/s, without and with layer-wise weight updates (`memory.layerwise`); blank where "
    f"no such trial finished. {SHARED}: measured on a shared or loaded machine (another trial "
    "ran on the same host, or its load average exceeded the cores), not comparable with a "
    "tok/s measured alone."
)
COMPARE_NOTE = (
    "Ours at each configuration's best LR (mean ± 95% CI over seeds where several); "
    "difference = ours − paper. Rows are matched by model size (or GLUE task), method and, "
    "for GLUE, rank. `differs` lists each setting of the paper's recipe (as its text or its "
    "authors' scripts state it; each with its source in analysis/paper/settings.csv) that our "
    "trials hold otherwise, as key ours≠paper; `unknown`, those our trials do not record "
    "(runs from before the key existed). Both empty: every recorded setting matches."
)


def pretrain_table(trials: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """Rows: methods (sweep order first); columns: model sizes; cells "ppl (peak memory)"."""
    ours = _pretraining(trials)
    keys = [*ROW, "model"]
    picks = best_lr(ours, keys)
    picks["peak"] = _at_best(ours, picks, keys, "peak_memory_bytes")
    models = _model_order(ours["model"])
    cells = {(*pick[keys],): _ppl_cell(pick) for _, pick in picks.iterrows()}
    rows = _rows(ours[ROW], order)
    table = pd.DataFrame({"method": _names(rows)})
    for model in models:
        table[SIZES.get(model, model)] = [cells.get((*row, model), "") for row in rows]
    return table


def throughput_table(trials: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """Rows: methods; columns: memory and tok/s without, then with, layer-wise updates; a
    `model` column is added when the sweep has more than one."""
    ours = _pretraining(trials)
    ours = ours.assign(layerwise=layerwise(ours), memory=ours["memory"].map(_without_layerwise))
    keys = [*ROW, "model", "layerwise"]
    picks = best_lr(ours, keys)
    picks["peak"] = _at_best(ours, picks, keys, "peak_memory_bytes")
    picks["rate"] = _at_best(ours, picks, keys, "tokens_per_s")
    flags = ours.assign(shared=shared(ours).astype(float))
    picks["shared"] = at_best(flags, picks, keys, "shared", "max")  # 1: a seed ran shared
    cells = {(*pick[keys],): (gigabytes(pick["peak"]), cell(pick["rate"], ",.0f")
                              + (f" {SHARED}" if pick["shared"] == 1 else ""))
             for _, pick in picks.iterrows()}
    rows = _rows(ours[[*ROW, "model"]], order)
    table = pd.DataFrame({"method": _names([row[:3] for row in rows])})
    if ours["model"].nunique() > 1:
        table["model"] = [SIZES.get(row[3], row[3]) for row in rows]
    blank = ("", "")
    for i, column in enumerate(THROUGHPUT_COLUMNS):
        table[column] = [cells.get((*row, i >= 2), blank)[i % 2] for row in rows]
    return table


def comparison_table(compared: pd.DataFrame) -> pd.DataFrame:
    """A `paper.compare_*` frame as strings: our configuration, the paper's setting, both
    numbers, the difference (ours − paper) and the source."""
    steps = compared["steps"].notna().any()
    names = _names([(*row,) for row in compared[ROW].itertuples(index=False)])
    table = pd.DataFrame({"method": names, "model": compared["model"].tolist()})
    if steps:
        table["steps"] = [cell(v, ".0f") for v in compared["steps"]]
    table["lr"] = [f"{v:g}" for v in compared["lr"]]
    table["setting"] = compared["setting"].tolist()
    table["metric"] = compared["metric"].tolist()
    table["paper"] = [f"{v:.2f}" for v in compared["paper"]]
    stats = zip(compared["ours"], compared["ci"], compared["n"], strict=True)
    table["ours"] = [format_ci(mean, ci, n) for mean, ci, n in stats]
    table["difference"] = ["" if pd.isna(v) else f"{v:+.2f}" for v in compared["difference"]]
    table["differs"] = compared["differs"].tolist()
    table["unknown"] = compared["unknown"].tolist()
    table["source"] = compared["source"].tolist()
    return table


def comparison_flag(table: pd.DataFrame) -> str:
    """One sentence, read before the table, saying how many comparisons are not like for
    like, so a mismatch is not left to a column at the far right."""
    differ = int((table["differs"] != "").sum())
    unknown = int(((table["differs"] == "") & (table["unknown"] != "")).sum())
    if differ:
        more = f"; {unknown} more cannot be checked (`unknown`)" if unknown else ""
        return (f"Not like for like: {differ} of {len(table)} comparisons ran with settings "
                f"that differ from the paper's (`differs`){more}.")
    if unknown:
        return (f"Unchecked: {unknown} of {len(table)} comparisons ran with settings our "
                "trials do not record (`unknown`).")
    return "Every comparison ran with the paper's recorded settings."


Builder = Callable[[pd.DataFrame, Sequence[str]], pd.DataFrame]
TABLES: tuple[tuple[str, str, str, Builder], ...] = (
    ("pretrain", PRETRAIN_TITLE, PRETRAIN_NOTE, pretrain_table),
    ("throughput", THROUGHPUT_TITLE, THROUGHPUT_NOTE, throughput_table),
    ("glue", GLUE_TITLE, GLUE_NOTE,
     lambda trials, order: glue_table(trials, order) if has_glue(trials) else pd.DataFrame()),
    ("paper_pretrain", "Ours vs published: pretraining perplexity", COMPARE_NOTE,
     lambda trials, _: comparison_table(compare_pretrain(trials))),
    ("paper_glue", "Ours vs published: GLUE (GaLore Table 4)", COMPARE_NOTE,
     lambda trials, _: comparison_table(compare_glue(trials))),
    ("paper_throughput", "Ours vs published: LLaMA-1B throughput (GaLore Table 11)",
     COMPARE_NOTE, lambda trials, _: comparison_table(compare_throughput(trials))),
    ("paper_anchors", "Ours vs published: Scaling for Scaling (perplexity, optimizer state)",
     COMPARE_NOTE, lambda trials, _: comparison_table(compare_anchors(trials))),
)  # fmt: skip


def write_tables(
    trials: pd.DataFrame, out_dir: Path | str, order: Sequence[str] = ()
) -> list[tuple[str, str, pd.DataFrame]]:
    """Write <slug>.csv and <slug>.md for each non-empty table; return (title, note, table)
    for the report to show; a comparison's note starts with its flag."""
    written = []
    for slug, title, note, build in TABLES:
        table = mark_methods(build(trials, order), trials)  # rows missing a result: ⚠
        if table.empty:
            continue
        if "differs" in table:
            note = f"{comparison_flag(table)} {note}"
        atomic_write(Path(out_dir) / f"{slug}.csv", table.to_csv(index=False))
        atomic_write(Path(out_dir) / f"{slug}.md", f"# {title}\n\n{note}\n\n{text_table(table)}\n")
        written.append((title, note, table))
    return written


def _at_best(trials: pd.DataFrame, picks: pd.DataFrame, keys: list[str],
             metric: str) -> pd.Series:
    """A metric at each pick's best LR, its seeds folded as the registry says."""
    return at_best(trials, picks, keys, metric, METRICS[metric].across_seeds)


def _pretraining(trials: pd.DataFrame) -> pd.DataFrame:
    filled = variants(trials)
    return filled[task_kind(filled) == "pretrain"]


def _rows(frame: pd.DataFrame, order: Sequence[str]) -> list[tuple]:
    """Distinct rows, methods named in `order` first, the rest alphabetically; a method's
    variants keep the order they first appear in."""
    rank = {label: i for i, label in enumerate(order)}
    rows = list(dict.fromkeys(frame.itertuples(index=False, name=None)))
    return sorted(rows, key=lambda row: (0, rank[row[0]], "") if row[0] in rank else (1, 0, row[0]))


def _names(rows: Sequence[tuple]) -> list[str]:
    """The method label, plus its memory modifiers and precision where that label has rows
    differing in them ("full (recompute full)"), so every row is told apart tersely."""
    names = []
    for method, memory, precision in rows:
        same = [row for row in rows if row[0] == method]
        extra = [value for i, value in ((1, memory), (2, precision))
                 if len({row[i] for row in same}) > 1]
        names.append(f"{method} ({', '.join(extra)})" if extra else method)
    return names


def _model_order(models: pd.Series) -> list[str]:
    """Known presets smallest first, then any other model alphabetically."""
    present = set(models)
    return [m for m in MODEL_ORDER if m in present] + sorted(present - set(MODEL_ORDER))


def _without_layerwise(label: str) -> str:
    """The memory label minus "layerwise", which Table 11 makes a column instead of a row."""
    parts = [part for part in label.split(", ") if part != "layerwise"]
    return ", ".join(parts) or "none"


def gigabytes(value: float) -> str:
    """Decimal GB, as the papers' tables quote memory."""
    return cell(value / 1e9, ".2f", " GB")


def _ppl_cell(pick: pd.Series) -> str:
    ppl = format_ci(pick["mean"], pick["ci"], pick["n"])
    return ppl if pd.isna(pick["peak"]) else f"{ppl} ({gigabytes(pick['peak'])})"
