"""A trial's downstream scores, `eval.json` beside its final model:

    {"tasks": {task: {"metrics": {name: value}, "stderr": {name: value}, "n": int,
                      "n_total": int, "version": ..., "num_fewshot": int, "limit": int|null,
                      "lm_eval": "0.4.13", "model_step": int, "evaluated_at": "...Z"}}}

Each `harness eval` merges its tasks in: a task evaluated again replaces only its own entry,
and the others stay as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.errors import UserError
from harness.trials import TrialDir, write_json
from harness.trials.files import UnreadableFile, read_json_record


def read_scores(trial: TrialDir) -> dict[str, Any]:
    """The trial's task entries, {} when it has none. UserError when `eval.json` is there but
    cannot be read: it is never written over."""
    try:
        data = read_json_record(trial.downstream)
    except UnreadableFile as e:
        raise UserError(f"{e}; move it aside to evaluate this trial again") from None
    tasks = (data or {}).get("tasks", {})
    return tasks if isinstance(tasks, dict) else {}


def merge_scores(trial: TrialDir, entries: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """`entries` written into the trial's `eval.json` over the same tasks' older ones, the
    other tasks kept; the whole file's tasks."""
    tasks = {**read_scores(trial), **entries}
    write_json(trial.downstream, {"tasks": dict(sorted(tasks.items()))})
    return tasks
