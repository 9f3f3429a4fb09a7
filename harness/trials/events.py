"""A method's step event (what `Method.on_step` returns: ReLoRA's merge, Q-GaLore's or GaLore's
SVDs, APOLLO's projections) as one readable progress line. The metrics line keeps the dict
itself; this is only how a person reads it on the terminal or in a job's log.

Such internal lines (`say_event`) reach the terminal only under `harness --verbose`, which sets
HARNESS_VERBOSE=1 for the process and every trial it starts; otherwise they go to stderr when
that is a log (a sweep trial's stderr.log, a launcher's job file) and nowhere on a terminal."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping

VERBOSE_ENV = "HARNESS_VERBOSE"


def set_verbose(on: bool) -> None:
    """In the environment, so that trial processes (forked or submitted) inherit it."""
    os.environ[VERBOSE_ENV] = "1" if on else "0"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def say_event(text: str) -> None:
    """An internal line (a trial's threads, a method's step event): stdout under --verbose,
    else the log that stderr is; a terminal without --verbose does not see it."""
    if verbose():
        print(text, flush=True)
    elif not sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def event_text(events: Mapping[str, object]) -> str:
    """`qgalore_svd 3 (svd_total 12, svd_skipped 2, gap_mean 17.5, ...)`: the first entry says
    what happened, the others follow in brackets. Keys stay as metrics.jsonl spells them, so a
    line on the terminal can be found in the file."""
    if not events:
        return ""
    (first, value), *rest = events.items()
    head = f"{first} {number_text(value)}"
    if not rest:
        return head
    return f"{head} ({', '.join(f'{key} {number_text(v)}' for key, v in rest)})"


def number_text(value: object) -> str:
    """Counts with thousands separators, fractions to four significant digits (a mean gap of
    17.333333 reads 17.33, 15.0 reads 15), flags as yes/no; anything else as `str` gives it."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if math.isfinite(value) else str(value)
    return str(value)
