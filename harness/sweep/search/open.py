"""The one place that tells a grid from an Optuna search: the sweep's `search.sampler`."""

from __future__ import annotations

from pathlib import Path

from harness.config import SweepConfig
from harness.sweep.search.grid import GridSearch
from harness.sweep.search.source import Search
from harness.sweep.search.study_source import StudySearch


def open_search(sweep: SweepConfig, out: Path) -> Search:
    """The sweep's search over its runs folder `out`; nothing is read or opened yet."""
    kind = GridSearch if sweep.search.sampler == "grid" else StudySearch
    return kind(sweep, out)
