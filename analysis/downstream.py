"""Downstream scores in the report: each trial `harness eval` scored (its `eval.json`), a
column per task with the task's headline metric, and their average.

A task's headline is lm-eval's usual one: `acc_norm` where the task reports it (HellaSwag,
ARC, PIQA, c4_sample_choice), else `acc` (WinoGrande, LAMBADA). The average is over the
tasks shown, so it is blank for a trial missing any of them: averages then compare like with
like. Standard errors and example counts stay in each trial's eval.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from harness.errors import UserError
from harness.eval.store import read_scores
from harness.trials import RunsDir, atomic_write

from .format import VARIANT_DEFAULTS, cell, fill_variants, text_table, variant_label
from .html import Block, Heading, Paragraph, Table

TITLE = "Downstream scores"
SLUG = "downstream"
HEADLINE = ("acc_norm", "acc")  # the first a task reports is its column
AVERAGE = "average"
VARIANT = list(VARIANT_DEFAULTS)  # method, memory, precision: the row's label


def headline(entry: dict[str, Any]) -> tuple[str, float] | None:
    """(metric, value) a task's column shows; None when it reports neither."""
    metrics = entry.get("metrics") or {}
    return next(((m, metrics[m]) for m in HEADLINE if metrics.get(m) is not None), None)


def downstream_table(trials: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """A row per scored trial (method, trial, LR, eval ppl, a column per task, the average),
    and a line for each eval.json that cannot be read or that holds a task scored on part of
    its examples (`--limit`)."""
    rows, notes = [], []
    for _, trial in fill_variants(trials).iterrows():
        folder = RunsDir(trial["run_dir"]).trial(trial["trial"])
        try:
            tasks = read_scores(folder)
        except UserError as e:
            notes.append(f"{e}: its scores are left out.")
            continue
        scores = {f"{task} {h[0]}": h[1] for task, entry in tasks.items()
                  if (h := headline(entry)) is not None}
        if not scores:
            continue
        part = [f"{task} ({entry['n']} of {entry['n_total']})" for task, entry in tasks.items()
                if entry.get("limit") and entry.get("n") != entry.get("n_total")]
        if part:
            notes.append(f"{trial['trial']}: scored on part of the examples: {', '.join(part)}.")
        rows.append({"method": variant_label(*trial[VARIANT]), "trial": trial["trial"],
                     "lr": cell(trial.get("lr"), "g"), "eval ppl": cell(trial.get("eval_ppl"),
                                                                        ".2f"), **scores})
    if not rows:
        return pd.DataFrame(), notes
    frame = pd.DataFrame(rows)
    columns = sorted(c for c in frame.columns if c not in ("method", "trial", "lr", "eval ppl"))
    frame[AVERAGE] = frame[columns].mean(axis=1, skipna=False)
    for column in [*columns, AVERAGE]:
        frame[column] = frame[column].map(lambda v: cell(v, ".4f"))
    return frame[["method", "trial", "lr", "eval ppl", *columns, AVERAGE]], notes


def downstream_section(trials: pd.DataFrame, out: Path) -> tuple[list[Block], list[str]]:
    """The report's blocks and terminal text for the scores, the table written as
    downstream.csv and .md; nothing when no trial was scored."""
    table, notes = downstream_table(trials)
    if table.empty and not notes:
        return [], []
    note = (f"lm-eval scores of the final models (`harness eval`): per task its "
            f"{' or '.join(HEADLINE)}, and their {AVERAGE} where a trial has every task.")
    atomic_write(out / f"{SLUG}.csv", table.to_csv(index=False))
    atomic_write(out / f"{SLUG}.md", f"# {TITLE}\n\n{note}\n\n{text_table(table)}\n")
    blocks: list[Block] = [Heading(TITLE), Paragraph(note),
                           *([Table(table)] if not table.empty else []), *map(Paragraph, notes)]
    return blocks, ["\n".join([TITLE, text_table(table), *notes])]

