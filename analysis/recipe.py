"""The recipe behind each published number (paper/settings.csv), and where ours departs from it.

A published perplexity was reached with some steps, batch, precision and method settings; ours
next to it means little unless ours ran the same way. settings.csv records, per paper table
(`table`, the CSV's stem), row (`method`, the paper's name, `*` for every row), column
(`model` or GLUE task, `*` for every column) and, for GLUE, `rank`, each setting that the paper
or its authors' scripts state, under our config's dotted key, with its `source`. Only stated
values are recorded: a setting a source does not give is absent, not guessed.

Keys are our config's flattened names (`analysis.load`), with two readings of our own:
`train.total_batch_size` is `train.batch_size` where it is unset (no accumulation), and
`tokens_per_step` is that times `task.seq_len` (GaLore Table 11's "token batch size"). A value
`>N` asks for more than N (ReLoRA's warm start has steps, their number not stated). A key a
trial does not record (a run from before the key existed) is unknown, never a match.
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources
from numbers import Number
from typing import Any

import pandas as pd

# Where a key's value sits in a trial's row when not under its own name: the summary records
# what ran (steps, lr) and load.py fills in precision's default and its old spellings.
COLUMNS = {"train.steps": "steps", "train.lr": "lr", "train.precision": "precision"}
# Keys every run's config has held since the first commit, where null means off: a missing
# value there is "none", not unknown.
NULL_IS_OFF = {"train.grad_clip"}
Recipe = dict[str, tuple[str, str]]  # key -> (the paper's value, its source)


@cache
def load_paper(name: str) -> pd.DataFrame:
    """One published table by file stem (e.g. "galore_table2"), shipped with the package."""
    path = resources.files("harness.analysis").joinpath(f"paper/{name}.csv")
    with path.open(encoding="utf-8") as f:
        return pd.read_csv(f, dtype={"value": str} if name == "settings" else None)


def recipe(table: str, method: str, column: str, rank: Any = None) -> Recipe:
    """The recorded settings of one published number; where a key is recorded for the whole
    table and for this row or column, the more specific record wins."""
    rows = load_paper("settings")
    same_rank = rows["rank"].isna() | (rows["rank"] == rank if not pd.isna(rank) else False)
    rows = rows[(rows["table"] == table) & rows["method"].isin(["*", method])
                & rows["model"].isin(["*", column]) & same_rank]
    specific = ((rows["method"] != "*").astype(int) + (rows["model"] != "*")
                + rows["rank"].notna())
    rows = rows.assign(specific=specific).sort_values("specific", ascending=False, kind="stable")
    return {row.key: (row.value, row.source)
            for row in rows.drop_duplicates("key").sort_index().itertuples(index=False)}


def departures(trials: pd.DataFrame, wanted: Recipe) -> tuple[str, str]:
    """(differs, unknown) for one configuration's trials against a recipe: "key ours≠paper"
    items where a trial's value differs, and "key (paper: value)" items where the trials do
    not record it; both empty when every recorded setting matches."""
    differs, unknown = [], []
    for key, (paper, _) in wanted.items():
        values = _values(trials, key)
        if not values or None in values:
            unknown.append(f"{key} (paper: {paper})")
        elif any(not _same(v, paper) for v in values):
            differs.append(f"{key} {'/'.join(values)}≠{paper}")
    return "; ".join(differs), "; ".join(unknown)


def _values(trials: pd.DataFrame, key: str) -> list[str | None]:
    """The distinct values the trials hold for `key`, normalized; [] when no trial has it."""
    column = _column(trials, key)
    if column is None:
        return []
    texts = (_text(v) for v in column)
    if key in NULL_IS_OFF:
        texts = ("none" if text is None else text for text in texts)
    return list(dict.fromkeys(texts))


def _column(trials: pd.DataFrame, key: str) -> pd.Series | None:
    if key == "train.total_batch_size":
        return _batch(trials)
    if key == "tokens_per_step":
        return _tokens(trials)
    return trials.get(COLUMNS.get(key, key))


def _batch(trials: pd.DataFrame) -> pd.Series | None:
    """Sequences per optimizer step: total_batch_size, or batch_size where that is unset."""
    present = [trials[k] for k in ("train.total_batch_size", "train.batch_size") if k in trials]
    if not present:
        return None
    return present[0].combine_first(present[-1])


def _tokens(trials: pd.DataFrame) -> pd.Series | None:
    batch = _batch(trials)
    if batch is None or "task.seq_len" not in trials:
        return None
    return pd.to_numeric(batch, errors="coerce") * pd.to_numeric(trials["task.seq_len"])


def _text(value: Any) -> str | None:
    """A config value as settings.csv writes it: numbers "%g", pairs "(a, b)", booleans
    lower-case; None where unset (NaN, None)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or str(value) in ("True", "False"):
        return str(value).lower()
    if isinstance(value, Number):
        return f"{float(value):g}"
    text = str(value).strip()
    if text[:1] in "[(" and text[-1:] in "])":
        return "(" + ", ".join(_text(_number(p)) or "" for p in text[1:-1].split(",")) + ")"
    number = _number(text)
    return f"{number:g}" if isinstance(number, float) else text


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text.strip()


def _same(ours: str, paper: str) -> bool:
    if paper.startswith(">"):
        number = _number(ours)
        return isinstance(number, float) and number > float(paper[1:])
    return ours == _text(paper)
