"""The trials table `harness status` prints: it needs no figure, so a status process (and a
sweep, which counts its trials' statuses at its end) loads neither matplotlib nor scipy for
it: their imports would be most of its start-up."""

from __future__ import annotations

import pandas as pd

from harness.cost.estimate import human_bytes

from .format import cell, text_table, whole
from .unreadable import unreadable_lines


def status_table(trials: pd.DataFrame) -> str:
    """Per-trial progress for `harness status`, readable while a sweep is still running; then
    one line for each trial whose summary.json cannot be read, naming the file and why."""
    table = pd.DataFrame(
        {
            "id": trials["trial"],
            "method": trials["method"],
            "memory": trials["memory"].fillna("none"),
            "status": trials["status"],
            "step": [
                f"{whole(step, '0')}/{whole(steps, '?')}"
                for step, steps in zip(trials["step"], trials["steps"], strict=True)
            ],
            "loss": trials["last_loss"].map(lambda v: cell(v, ".4f")),
            "eval ppl": trials["eval_ppl"].map(lambda v: cell(v, ".2f")),
            "tok/s": trials["tokens_per_s"].map(lambda v: cell(v, ",.0f")),
            "peak memory": trials["peak_memory_bytes"].map(human_bytes),
            "peak RSS": trials["peak_rss_bytes"].map(human_bytes),
            "requeues": trials["requeues"].map(lambda v: whole(v, "0")),
            "final model": trials["final_model_bytes"].map(human_bytes),
        }
    )
    return "\n".join([text_table(table), *unreadable_lines(trials)])
