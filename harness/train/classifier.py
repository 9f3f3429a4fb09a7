"""Models for fine-tuning: an encoder from the hub or a folder, or a LLaMA with a
classification head whose body comes from a harness pretraining checkpoint."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from torch import nn

from harness import distributed
from harness.config import ModelFrom, RunConfig, read_yaml
from harness.data.c4 import load_tokenizer
from harness.errors import UserError, brief
from harness.methods import build_method
from harness.methods.resolve import load_run
from harness.models import PRESETS, build_model, llama_config
from harness.trials import CheckpointError, RunsDir, Status, TrialDir, checkpoints


def build_classifier(run: RunConfig, num_labels: int) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for a GLUE run; the head is new, the body pretrained (or random for
    a preset, which tests use)."""
    dropout = run.task.classifier_dropout
    if (isinstance(run.model, ModelFrom) or run.model in PRESETS) and dropout is not None:
        raise UserError("task.classifier_dropout: a LLaMA classification head has no "
                        "dropout (leave it null), only encoders do")
    if isinstance(run.model, ModelFrom):
        return from_checkpoint(resolve_trial(run.model.from_), num_labels)
    if run.model in PRESETS:
        tok = load_tokenizer(run.task.tokenizer)
        return llama_classifier(run.model, tok, num_labels, run.task.seq_len), tok
    return pretrained(run.model, num_labels, dropout)


def llama_classifier(preset: str, tok: Any, num_labels: int, seq_len: int) -> nn.Module:
    from transformers import LlamaForSequenceClassification

    config = llama_config(preset, len(tok), seq_len, tok.pad_token_id, num_labels=num_labels)
    return LlamaForSequenceClassification(config)


def pretrained(name: str, num_labels: int, dropout: float | None) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    extra = {} if dropout is None else {"classifier_dropout": dropout}
    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=num_labels, **extra)
    except (OSError, ValueError) as e:
        reason = brief(e)
        raise UserError(f"model: cannot load '{name}' ({reason}); give a preset, a local "
                        "model folder, a reachable hub name, or {from: runs/<sweep>}") from None
    return model, tok


PLAIN = ("full", "adam8bit", "lora", "relora", "galore")  # checkpoints that become a plain LLaMA


def resolve_trial(path: str) -> Path:
    """A trial folder as given, or a sweep's best finished trial (lowest eval perplexity) among
    those whose weights convert to a plain LLaMA."""
    folder = Path(path).expanduser()
    if TrialDir(folder).is_trial():
        return folder
    runs = RunsDir(folder)
    if not runs.is_runs_dir():
        raise UserError(f"model.from: {folder} is neither a trial folder (config.yaml) nor a "
                        "runs directory (trials/); pretrain it first")
    summaries = [s for t in runs.trial_dirs() if (s := t.read_summary()) is not None]
    done = [s for s in summaries if s.status == Status.OK and s.method_name in PLAIN
            and not math.isnan(s.eval_ppl or math.nan)]
    if not done:
        raise UserError(f"model.from: {folder} has no finished trial with an eval perplexity "
                        f"whose method is one of {', '.join(PLAIN)}")
    best = min(done, key=lambda s: s.eval_ppl)
    distributed.say(f"model.from: {folder}'s best trial is {best.trial} "
                    f"({best.method}, eval ppl {best.eval_ppl:.2f})")
    return runs.trial(str(best.trial)).path


def from_checkpoint(trial: Path, num_labels: int) -> tuple[nn.Module, Any]:
    """The trial's model as it trained (its method's `prepare`, its checkpoint), merged back to
    a plain LLaMA (LoRA/ReLoRA adapters folded in), then its body under a new head."""

    source = load_run(read_yaml(TrialDir(trial).config))
    try:  # the newest that loads: one that does not is named and skipped
        found = checkpoints.load_newest(TrialDir(trial).checkpoints)
    except CheckpointError as e:
        raise UserError(f"model.from: {e}") from e
    if found is None:
        raise UserError(f"model.from: {trial} has no checkpoint/state.pt (did it finish?)")
    for path, why in found.skipped if distributed.is_main() else ():
        print(f"warning: model.from: {path} does not load ({why}); using {found.path}",
              file=sys.stderr, flush=True)
    tok = load_tokenizer(source.task.tokenizer)
    trained = build_model(source.model, len(tok), source.task.seq_len, tok.pad_token_id)
    trained = build_method(source).prepare(trained, source)
    trained.load_state_dict(found.state["model"])
    if hasattr(trained, "merge_and_unload"):  # peft: W + s·B·A
        trained = trained.merge_and_unload()
    body = {k: v for k, v in trained.state_dict().items() if k.startswith("model.")}
    model = llama_classifier(source.model, tok, num_labels, source.task.seq_len)
    missing, unexpected = model.load_state_dict(body, strict=False)
    if unexpected or set(missing) != {"score.weight"}:
        raise UserError(f"model.from: {trial} was trained with method {source.method_name}, "
                        f"whose weights are not a plain LLaMA's (those of {', '.join(PLAIN)} are)")
    return model, tok
