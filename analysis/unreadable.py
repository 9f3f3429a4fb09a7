"""Trials whose summary.json cannot be read: the lines that name them (file and why), and the
⚠ that marks each report row whose best LR may be wrong without their results."""

from __future__ import annotations

import pandas as pd

from harness.trials import Status

MARK = "⚠"


def _unreadable(trials: pd.DataFrame) -> pd.DataFrame:
    return trials[trials["status"] == Status.UNREADABLE]


def unreadable_lines(trials: pd.DataFrame) -> list[str]:
    """One line per trial whose record cannot be read: its id, the file and why."""
    rows = _unreadable(trials)[["trial", "error"]].itertuples(index=False)
    return [f"unreadable: {trial} ({error})" for trial, error in rows]


def unreadable_note(trials: pd.DataFrame) -> list[str]:
    """The report's warning, [] when every record was read: how many results are missing,
    which rows they may change, and every file with why."""
    lines = unreadable_lines(trials)
    if not lines:
        return []
    return [f"{MARK} Trial records that cannot be read ({len(lines)}): their results are left "
            f"out, so the rows marked {MARK} may name another best LR than all their trials "
            f"would; `harness sweep --retry-failed` trains them again. {'; '.join(lines)}."]


def with_mark(cell: str, group: pd.DataFrame) -> str:
    """`cell` with the mark when `group` (one row's trials) holds an unreadable one."""
    return f"{cell} {MARK}".strip() if len(_unreadable(group)) else cell


def mark_methods(table: pd.DataFrame, trials: pd.DataFrame) -> pd.DataFrame:
    """A paper-format table with the mark on each `method` cell whose label ("full", or
    "full (recompute full)") has an unreadable trial: its rows cannot be told apart finer."""
    labels = set(_unreadable(trials)["method"].dropna().astype(str))
    if not labels or "method" not in table:
        return table
    hit = [str(name).split(" (")[0] in labels for name in table["method"]]
    return table.assign(method=[f"{name} {MARK}" if h else name
                                for name, h in zip(table["method"], hit, strict=True)])
