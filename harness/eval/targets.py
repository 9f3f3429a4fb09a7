"""Which final models `harness eval` scores: a trial folder's, or every finished trial's of a
runs directory (each other trial one line saying why it is left out)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from harness.errors import UserError
from harness.trials import RunsDir, Status, TrialDir, final_model, read_json

Say = Callable[[str], None]  # where a line for the user goes


def not_scorable(trial: TrialDir) -> str | None:
    """Why the trial has no final model lm-eval can score; None when it has one."""
    summary = trial.read_summary()
    status = summary.get("status") if summary is not None else Status.PENDING
    if status != Status.OK:
        return f"status {status}: only a finished trial has a final model"
    if (trial.read_config().get("task") or {}).get("kind") == "glue":
        return "a GLUE classifier: lm-eval scores causal language models"
    if final_model.verified(trial.final_model) is None:
        return f"no final model in {trial.final_model} (train.keep_final: none, or not kept)"
    return None


def model_step(trial: TrialDir) -> int | None:
    """The training step the final model was written at (its record, model.json)."""
    return (read_json(final_model.record_of(trial.final_model)) or {}).get("step")


def targets(path: Path, say: Say) -> list[TrialDir]:
    """The trial at `path`, or every scorable trial under the runs directory at `path`.
    UserError (one line) when there is none."""
    trial = TrialDir(path)
    if trial.is_trial():
        why = not_scorable(trial)
        if why:
            raise UserError(f"{path}: nothing to evaluate: {why}")
        return [trial]
    if not RunsDir(path).is_runs_dir():
        raise UserError(f"{path}: neither a trial folder (config.yaml) nor a runs directory "
                        "(trials/); give runs/<sweep> or runs/<sweep>/trials/<id>")
    found = []
    for trial in RunsDir(path).trial_dirs():
        why = not_scorable(trial)
        if why:
            say(f"{trial.name}: skipped ({why})")
        else:
            found.append(trial)
    if not found:
        raise UserError(f"{path}: no finished trial with a final model to evaluate")
    return found
