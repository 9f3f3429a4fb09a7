"""Models for fine-tuning: an encoder or causal LM from the hub or a folder (an exported one
too), or a LLaMA with a classification head whose body is a harness pretraining trial's."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from harness import distributed
from harness.config import ModelFrom, RunConfig, read_yaml
from harness.config.hub import cache_only
from harness.data.c4 import load_tokenizer
from harness.distributed.materialize import Unsupported
from harness.errors import UserError, brief
from harness.methods.resolve import load_run
from harness.models import PRESETS
from harness.train import pretrain
from harness.train.build import llama_config
from harness.train.plain import newest_state, plain_model, save_hf
from harness.trials import RunsDir, Status, TrialDir, final_model

Load = Callable[[str, Any], nn.Module]  # (name, config) -> the model from_pretrained would load


def build_classifier(run: RunConfig, num_labels: int, load: Load | None = None
                     ) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for a GLUE run; the head is new, the body pretrained (or random for
    a preset, which tests use). `load`: what builds a pretrained model from its name and
    config instead of from_pretrained (on the meta device, harness/train/meta_build.py)."""
    dropout = run.task.classifier_dropout
    if (isinstance(run.model, ModelFrom) or run.model in PRESETS) and dropout is not None:
        raise UserError("task.classifier_dropout: a LLaMA classification head has no "
                        "dropout (leave it null), only encoders do")
    if isinstance(run.model, ModelFrom):
        return from_trial(resolve_trial(run.model.from_), num_labels, load)
    if run.model in PRESETS:
        tok = load_tokenizer(run.task.tokenizer)
        return llama_classifier(run.model, tok, num_labels, run.task.seq_len), tok
    return pretrained(run.model, num_labels, dropout, load)


def llama_classifier(preset: str, tok: Any, num_labels: int, seq_len: int) -> nn.Module:
    from transformers import LlamaForSequenceClassification

    config = llama_config(preset, len(tok), seq_len, tok.pad_token_id, num_labels=num_labels)
    return LlamaForSequenceClassification(config)


def pretrained(name: str, num_labels: int, dropout: float | None, load: Load | None = None
               ) -> tuple[nn.Module, Any]:
    # before transformers is imported: offline, a hub name not cached fails at once
    cached_only = not Path(name).expanduser().is_dir() and cache_only(
        "model", name, ("config.json",), "give a local model folder, a preset, or "
        "{from: runs/<sweep>}")
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    extra = {} if dropout is None else {"classifier_dropout": dropout}
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=cached_only)
        if load is None:
            model = AutoModelForSequenceClassification.from_pretrained(
                name, num_labels=num_labels, local_files_only=cached_only, **extra)
        else:  # the config as from_pretrained makes it of the same arguments
            model = load(name, AutoConfig.from_pretrained(
                name, num_labels=num_labels, local_files_only=cached_only, **extra))
    except (OSError, ValueError) as e:
        reason = brief(e)
        raise UserError(f"model: cannot load '{name}' ({reason}); give a preset, a local "
                        "model folder, a reachable hub name, or {from: runs/<sweep>}") from None
    return model, tok


def resolve_trial(path: str) -> Path:
    """A trial folder as given, or a sweep's best finished trial (lowest eval perplexity)."""
    folder = Path(path).expanduser()
    if TrialDir(folder).is_trial():
        return folder
    runs = RunsDir(folder)
    if not runs.is_runs_dir():
        raise UserError(f"model.from: {folder} is neither a trial folder (config.yaml) nor a "
                        "runs directory (trials/); pretrain it first")
    summaries = [s for t in runs.trial_dirs() if (s := t.read_summary()) is not None]
    for s in summaries:  # it may have been the best: say so rather than pass over it unseen
        if s.status == Status.UNREADABLE:
            distributed.say(f"model.from: {s.trial} left out: {s.error}")
    done = [s for s in summaries if s.status == Status.OK
            and not math.isnan(s.eval_ppl or math.nan)]
    if not done:
        raise UserError(f"model.from: {folder} has no finished trial with an eval perplexity")
    best = min(done, key=lambda s: s.eval_ppl)
    distributed.say(f"model.from: {folder}'s best trial is {best.trial} "
                    f"({best.method}, eval ppl {best.eval_ppl:.2f})")
    return runs.trial(str(best.trial)).path


def from_trial(trial: Path, num_labels: int, load: Load | None = None
               ) -> tuple[nn.Module, Any]:
    """The trial's final model under a new head; without one (an unfinished trial, or one
    that keeps none), its newest checkpoint as its method exports it (LoRA merged, INT8
    dequantized, ...), written to a temporary folder and loaded the same way (whole: not by
    `load`, which is `Unsupported` then)."""
    folder = TrialDir(trial).final_model
    if final_model.verified(folder) is not None:
        return pretrained(str(folder), num_labels, None, load)
    if load is not None:
        raise Unsupported(f"model.from: {trial} has no final model; its checkpoint is "
                          "exported whole")
    source = load_run(read_yaml(TrialDir(trial).config))
    try:
        state = newest_state(TrialDir(trial))
    except UserError as e:
        raise UserError(f"model.from: {e}") from None
    plain, tok = plain_model(source, state, pretrain.build)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(plain, tok, tmp)
        return pretrained(tmp, num_labels, None)
