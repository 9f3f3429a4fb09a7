"""What a finished trial keeps (`train.keep_final`) and `harness export`: a trial's model in
Hugging Face format, from its final model or its newest checkpoint (harness/train/plain.py).

A finished trial writes its final model and then drops its training state; a trial is
finished once that is done, and is never trained again for want of the state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.config import RunConfig, read_yaml
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.models import generation_ids, generation_ready
from harness.train import finetune, pretrain
from harness.train.plain import Build, newest_state, plain_model, save_plain
from harness.trials import Summary, TrialDir, final_model


def builder(run: RunConfig) -> Build:
    """The task's model builder, as the trainer picks it."""
    return finetune.build if run.task.kind == "glue" else pretrain.build


def generating(run: RunConfig, state: dict[str, Any]) -> tuple[Any, Any]:
    """The trial's plain model and tokenizer, its config's special ids the tokenizer's (the
    EOS training put between documents), ready for `generate()`."""
    model, tok = plain_model(run, state, builder(run))
    generation_ready(model, tok)
    return model, tok


def finish(run: RunConfig, trial: TrialDir, summary: dict[str, Any],
           state: dict[str, Any] | None = None) -> dict[str, Any]:
    """A trial that ended ok: its final model written as `train.keep_final` says (from `state`,
    its final checkpoint, or the newest read from disk), then its training state removed
    unless `full`; the summary's fields for it."""
    keep = run.train.keep_final
    kept: dict[str, Any] = {"keep_final": keep, "identity": run.identity()}
    if keep != "none":
        size = final_model.verified(trial.final_model)  # written before a kill: kept
        if size is None:
            model, tok = generating(run, state or newest_state(trial))
            size = save_plain(model, tok, trial.final_model, summary["step"])
        kept["final_model_bytes"] = size
    if keep != "full":
        final_model.remove_state(trial.checkpoints)
    return kept


def is_finished(run: RunConfig, trial: TrialDir, summary: Summary) -> bool:
    """A trial that ended ok and whose `finish` completed: its final model verifies, or it
    keeps none. Its training state is not needed (and is gone unless `keep_final: full`).
    UserError when it finished another config (its identity, kept in the summary)."""
    if summary.get("keep_final") is None:
        return False
    if summary.get("identity") != run.identity():
        raise UserError(f"{trial}: finished with a different config ({summary.get('identity')}, "
                        f"this run is {run.identity()}); use another --out or delete that folder")
    return (summary.get("keep_final") == "none"
            or final_model.verified(trial.final_model) is not None)


def export_trial(folder: Path, out: Path) -> int:
    """`harness export`: the trial's final model copied to `out`, or, without one (an
    interrupted trial, or one that keeps none), its newest checkpoint exported there."""
    trial = TrialDir(folder)
    if not trial.is_trial():
        raise UserError(f"{folder}: not a trial folder (no config.yaml); give "
                        "runs/<sweep>/trials/<id>")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; give a new one (an "
                        "export never writes over files)")
    have = final_model.verified(trial.final_model)
    if have is not None:
        final_model.copy(trial.final_model, out)
        _generation_ids_into(out)
        return have
    state = newest_state(trial)
    run = load_run(read_yaml(trial.config))
    model, tok = generating(run, state)
    return save_plain(model, tok, out, state["step"], record=False)


def _generation_ids_into(folder: Path) -> None:
    """A copied final model's configs given the tokenizer's ids as `generating` gives them:
    one written by an earlier version has LLaMA's defaults (EOS 2, the sample's `<unk>`)."""
    from transformers import AutoTokenizer

    if not (folder / "generation_config.json").is_file():
        return  # a classifier: nothing generates
    ids = generation_ids(AutoTokenizer.from_pretrained(folder))
    for name, keys in (("config.json", ids.keys() - {"pad_token_id"}),
                       ("generation_config.json", ids.keys())):
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**data, **{k: ids[k] for k in keys}}, indent=2,
                                              sort_keys=True) + "\n")
