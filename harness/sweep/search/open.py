"""The one place that tells a grid from an Optuna search or a coordinate descent: the sweep's
`search.sampler`, or its `tuning.procedure` (harness/sweep/search/tuned.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

from harness.config import SweepConfig
from harness.sweep.search.coordinate import CoordinateSearch
from harness.sweep.search.grid import GridSearch
from harness.sweep.search.source import Search
from harness.sweep.search.study_source import StudySearch
from harness.sweep.search.tuned import check_tuning, searched


def open_search(sweep: SweepConfig, out: Path) -> Search:
    """The sweep's search over its runs folder `out`; nothing is read or opened yet."""
    if sweep.tuning is not None and sweep.tuning.procedure == "coordinate":
        return CoordinateSearch(sweep, out)
    if sweep.tuning is not None:
        check_tuning(sweep)
        # a tuple setting's choices go to Optuna as lists, which it stores as JSON all the same
        warnings.filterwarnings("ignore", message="Choices for a categorical distribution")
        sweep = searched(sweep)
    kind = GridSearch if sweep.search.sampler == "grid" else StudySearch
    return kind(sweep, out)
