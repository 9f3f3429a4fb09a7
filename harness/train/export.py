"""What a finished trial keeps (`train.keep_final`) and `harness export`: a trial's model in
Hugging Face format, from its final model or its newest checkpoint (harness/train/plain.py).

A finished trial writes its final model and then drops its training state; a trial is
finished once that is done, and is never trained again for want of the state.

The model is written streamed (harness/trials/stream_export.py): its skeleton on the meta
device, each tensor read from the checkpoint (a sharded one's `model/`) as its turn in the
safetensors file comes; where the method's export changes the model (adapters merged, weights
dequantized), a unit (decoder layer, embedding, head) at a time, the method's `export` run on a
skeleton holding only that unit's weights. The files are those the whole model's save writes,
in the dtype the trial trained in: a bf16-true trial's all bfloat16 (a dequantized weight as
its forward cast it), others' float32.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from harness.config import ModelFrom, RunConfig, read_yaml
from harness.data.glue import get_task
from harness.errors import UserError
from harness.methods import Method, build_method
from harness.methods.resolve import load_run
from harness.models import PRESETS
from harness.modifiers.precision import pure_bf16
from harness.modifiers.recompute import decoder_layers
from harness.train import finetune, pretrain
from harness.train.build import generation_ids, generation_ready
from harness.train.classifier import resolve_trial
from harness.train.plain import Build, newest_state, plain_model, save_hf, save_plain
from harness.trials import Summary, TrialDir, final_model, sharded, stream_export

Fill = Callable[[dict[str, torch.Tensor]], None]  # tensors given their weights, in place


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
    keeps none, or its sweep dropped it (`keep_models`). Its training state is not needed (and
    is gone unless `keep_final: full`). UserError when it finished another config (its
    identity, kept in the summary)."""
    if summary.get("keep_final") is None:
        return False
    if summary.get("identity") != run.identity():
        raise UserError(f"{trial}: finished with a different config ({summary.get('identity')}, "
                        f"this run is {run.identity()}); use another --out or delete that folder")
    return (summary.get("keep_final") == "none" or bool(summary.get("final_model_dropped"))
            or final_model.verified(trial.final_model) is not None)


def export_trial(folder: Path, out: Path) -> int:
    """`harness export`: the trial's final model copied to `out`, or, without one (an
    interrupted trial, or one that keeps none), its newest checkpoint exported there. A model
    its sweep dropped (`keep_models`), with no checkpoint left: UserError saying so."""
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
    state = _state_or_dropped(trial)
    run = load_run(read_yaml(trial.config))
    return write_model(run, state, out, state["step"], record=False)


def _state_or_dropped(trial: TrialDir) -> dict[str, Any]:
    """The trial's newest checkpoint; where there is none and its sweep dropped its final
    model, UserError naming why and the trial that kept one."""
    try:
        return newest_state(trial)
    except UserError:
        summary = trial.read_summary()
        why = summary.get("final_model_dropped") if summary is not None else None
        if not why:
            raise
        kept = summary.get("final_model_kept_by")
        instead = f"; {kept} kept its model" if kept else ""
        raise UserError(f"{trial}: its final model was dropped ({why}) as its sweep ended"
                        f"{instead}; a sweep with keep_models: all keeps every trial's") from None


def write_model(run: RunConfig, state: dict[str, Any], folder: Path, step: int,
                record: bool = True) -> int:
    """The trial's model from `state` (a checkpoint's) in Hugging Face format into `folder`,
    verified (trials/final_model.py): streamed, else (`streamed` says when) built whole and
    exported by the method. Its bytes."""
    found = streamed(run, state)
    if found is None:
        model, tok = generating(run, state)
        return save_plain(model, tok, folder, step, record)
    skeleton, tok, read = found
    params = dict(skeleton.named_parameters(remove_duplicate=False))

    def save(tmp: Path) -> None:
        with stream_export.streaming(read):
            save_hf(skeleton, tok, tmp)

    same = stream_export.Lazy(skeleton.state_dict(), read,
                              lambda n: id(params[n]) if n in params else n)
    return final_model.write(folder, save, same, step, record)


def streamed(run: RunConfig, state: dict[str, Any]) -> tuple[Any, Any, stream_export.Read] | None:
    """The exported model's skeleton (weights on the meta device), the tokenizer, and how each
    weight is read: from the checkpoint as it is, or, where the method's export changes the
    model, a unit (decoder layer, embedding, head) at a time (`_by_unit`). None where the
    model cannot be built on the meta device (`skeleton_of`), or the checkpoint is of another
    layout (the whole load then names what differs)."""
    method = build_method(run)
    built = skeleton_of(run, method)
    if built is None:
        return None
    prepared, tok = built
    templates = prepared.state_dict()
    fill = _filler(state, templates)
    if fill is None:
        return None
    read: stream_export.Read = lambda name, like: _filled(fill, {name: like})[name]  # noqa: E731
    exported = prepared
    if type(method).export is not Method.export:
        fresh = _copies(prepared, run, method)
        exported = pure_bf16(method.export(fresh()), run.train)  # dequantized: float32
        units = _units(prepared, exported)
        if units is None:
            return None
        read = _by_unit(units, templates, exported, fresh, method, fill)
    generation_ready(exported, tok)
    return exported.eval(), tok, read


def skeleton_of(run: RunConfig, method: Method) -> tuple[Any, Any] | None:
    """The model as the trial built and prepared it, its weights on the meta device (nothing
    drawn, nothing held), and the tokenizer; None where it cannot be: a GLUE body from a
    trial without a final model, or a method whose `prepare` needs the weights (QLoRA:
    bitsandbytes quantizes each NF4 weight as it builds it)."""
    built = classifier_skeleton(run) if run.task.kind == "glue" else pretrain.build(
        run, skeleton=True)
    if built is None:
        return None
    model, tok = built
    try:
        model = pure_bf16(method.prepare(pure_bf16(model, run.train), run), run.train)
    except (RuntimeError, NotImplementedError):  # an op the meta device has no data for
        return None
    return model.eval(), tok


def classifier_skeleton(run: RunConfig) -> tuple[Any, Any] | None:
    """A GLUE run's classifier as finetune.build gives it, on the meta device: a preset's from
    its config, a folder's or hub model's from its config.json (from_pretrained reads weights);
    None for a trial's body without a final model, or a model whose files are not at hand
    (its export is built whole)."""
    if isinstance(run.model, ModelFrom):
        body = TrialDir(resolve_trial(run.model.from_)).final_model
        if final_model.verified(body) is None:
            return None
        name, extra = str(body), {}
    elif run.model in PRESETS:
        with torch.device("meta"):
            model, tok = finetune.build(run)
        return model, tok
    else:
        name = run.model
        dropout = run.task.classifier_dropout
        extra = {} if dropout is None else {"classifier_dropout": dropout}
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    labels = get_task(run.task.glue_task).num_labels
    try:
        config = AutoConfig.from_pretrained(name, num_labels=labels, **extra)
        tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):  # not at hand: the whole build says so in one line
        return None
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return model, tok


def _copies(prepared: nn.Module, run: RunConfig, method: Method) -> Callable[[], nn.Module]:
    """New copies of the meta skeleton, for exports to change: deep copies, except of one with
    parametrized weights, built anew (a deep copy shares its modules' classes, and torch's
    parametrize deletes the weight's property from the class as it removes one)."""
    if any(parametrize.is_parametrized(m) for m in prepared.modules()):
        return lambda: skeleton_of(run, method)[0]  # type: ignore[index]
    return lambda: copy.deepcopy(prepared)


def _units(prepared: nn.Module, exported: nn.Module) -> dict[str, str] | None:
    """Each unit of the exported model (stream_export.units) → the prepared model's unit it
    comes from (the one whose name ends with its name: peft adds a prefix). None where a unit
    has no one such source, or a weight lies outside every unit."""
    try:
        ours = stream_export.units(exported, decoder_layers(exported))
        theirs = stream_export.units(prepared, decoder_layers(prepared))
    except UserError:  # no stack of layers
        return None
    sources = {u: [p for p in theirs if f".{p}".endswith(f".{u}")] for u in ours}
    if any(len(found) != 1 for found in sources.values()) or any(
            not any(n.startswith(f"{u}.") for u in ours) for n in exported.state_dict()):
        return None
    return {u: found[0] for u, found in sources.items()}


def _by_unit(source: dict[str, str], templates: dict[str, torch.Tensor], exported: nn.Module,
             fresh: Callable[[], nn.Module], method: Method, fill: Fill) -> stream_export.Read:
    """Each exported weight as `method.export` of the whole loaded model gives it, computed a
    unit at a time: a `fresh` meta skeleton given only that unit's weights (`templates`' of
    its `source`, read from the checkpoint in one read, put in as they are), exported, its
    unit's tensors kept."""
    names = exported.state_dict()
    owner = {n: next(u for u in source if n.startswith(f"{u}.")) for n in names}

    def compute(unit: str) -> dict[str, torch.Tensor]:
        model = fresh()
        part, prefix = model.get_submodule(source[unit]), f"{source[unit]}."
        weights = _filled(fill, {k: t for k, t in templates.items() if k.startswith(prefix)})
        part.load_state_dict({k.removeprefix(prefix): t for k, t in weights.items()},
                             assign=True)  # the tensors read become the unit's: no copy
        del weights
        done = method.export(model).state_dict()
        tensors = {n: done[n].to(names[n].dtype) for n in names if owner[n] == unit}
        beyond = next((n for n, t in tensors.items() if t.is_meta), None)
        if beyond is not None:
            raise ValueError(f"{beyond}: its export needs weights outside {unit}")
        return tensors

    return stream_export.ByUnit(owner, compute)


def _filler(state: dict[str, Any], templates: dict[str, torch.Tensor]) -> Fill | None:
    """How tensors are filled with their weights as `load_state_dict` would put them in the
    model (the model's dtype): from a sharded checkpoint's `model/`, verified as read; from a
    one-process one's state in memory. None where the checkpoint lacks a weight or holds it in
    another shape."""
    if "sharded" not in state:
        weights = state["model"]
        if any(k not in weights or weights[k].shape != t.shape for k, t in templates.items()):
            return None

        def copy(tensors: dict[str, torch.Tensor]) -> None:
            for name, out in tensors.items():
                out.copy_(weights[name])

        return copy
    path = state["sharded"]
    _load(state, {})  # its metadata verified (nothing else read), then the layout checked
    saved = sharded.dcp().FileSystemReader(path / "model").read_metadata().state_dict_metadata
    sharded.same_layout(path, "model", templates, saved)
    return lambda tensors: _load(state, tensors)


def _filled(fill: Fill, templates: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New host tensors shaped as `templates`, filled by `fill` in one read."""
    tensors = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in templates.items()}
    fill(tensors)
    return tensors


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
