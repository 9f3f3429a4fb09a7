"""What a finished trial keeps (`train.keep_final`) and `harness export`: a trial's model in
Hugging Face format, from its final model or its newest checkpoint (harness/train/plain.py).

A finished trial writes its final model and then drops its training state; a trial is
finished once that is done, and is never trained again for want of the state.

A pretraining trial whose method exports its model as trained (no adapters to merge, no weights
to dequantize) is written streamed (harness/trials/stream_export.py): its skeleton on the meta
device, each tensor read from the checkpoint (a sharded one's `model/`, one at a time) as its
turn in the safetensors file comes; the files are those the whole model's save writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from harness.config import RunConfig, read_yaml
from harness.errors import UserError
from harness.methods import Method, build_method
from harness.methods.resolve import load_run
from harness.models import generation_ids, generation_ready
from harness.modifiers.precision import pure_bf16
from harness.train import finetune, pretrain
from harness.train.plain import Build, newest_state, plain_model, save_plain
from harness.trials import Summary, TrialDir, final_model, sharded, stream_export


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
            size = write_model(run, state or newest_state(trial), trial.final_model,
                               summary["step"])
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
    return write_model(run, state, out, state["step"], record=False)


def write_model(run: RunConfig, state: dict[str, Any], folder: Path, step: int,
                record: bool = True) -> int:
    """The trial's model from `state` (a checkpoint's) in Hugging Face format into `folder`,
    verified (trials/final_model.py): streamed where the method exports the model as trained,
    else built whole and exported by the method. Its bytes."""
    if run.task.kind == "glue" or type(build_method(run)).export is not Method.export:
        model, tok = generating(run, state)
        return save_plain(model, tok, folder, step, record)
    skeleton, tok = skeleton_of(run)
    read = _reader(state, skeleton.state_dict())
    if read is None:  # a checkpoint of another layout: the whole load names what differs
        model, tok = generating(run, state)
        return save_plain(model, tok, folder, step, record)
    params = dict(skeleton.named_parameters(remove_duplicate=False))

    def save(tmp: Path) -> None:
        with stream_export.streaming(read):
            skeleton.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    same = stream_export.Lazy(skeleton.state_dict(), read,
                              lambda n: id(params[n]) if n in params else n)
    return final_model.write(folder, save, same, step, record)


def skeleton_of(run: RunConfig) -> tuple[Any, Any]:
    """The plain model as `generating` gives it, its weights on the meta device (nothing
    drawn, nothing held), and the tokenizer."""
    model, tok = pretrain.build(run, skeleton=True)
    model = pure_bf16(build_method(run).prepare(pure_bf16(model, run.train), run), run.train)
    generation_ready(model, tok)
    return model.eval(), tok


def _reader(state: dict[str, Any],
            templates: dict[str, torch.Tensor]) -> stream_export.Read | None:
    """Each weight as `load_state_dict` would put it in the model (the model's dtype), read
    alone: from a sharded checkpoint's `model/`, verified as read; from a one-process one's
    state in memory. None where the checkpoint lacks a weight or holds it in another shape."""
    if "sharded" not in state:
        weights = state["model"]
        if any(k not in weights or weights[k].shape != t.shape for k, t in templates.items()):
            return None
        return lambda name, like: weights[name].to(like.dtype)
    path = state["sharded"]
    _load(state, {})  # its metadata verified (nothing else read), then the layout checked
    saved = sharded.dcp().FileSystemReader(path / "model").read_metadata().state_dict_metadata
    sharded.same_layout(path, "model", templates, saved)

    def read(name: str, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty(like.shape, dtype=like.dtype)
        _load(state, {name: out})
        return out

    return read


def _load(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` read from a sharded checkpoint's `model/`; UserError (one line) where a byte
    range is not the one written."""
    try:
        sharded.load(state["sharded"], "model", tensors, state["record"])
    except sharded.Corrupt as e:
        raise UserError(f"checkpoint {state['sharded']}: {e}") from None


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
