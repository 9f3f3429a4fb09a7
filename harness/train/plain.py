"""A trial's model as a plain Hugging Face model: built as the trial built it (by its task's
`build`), its checkpoint loaded (a sharded one's weights alone, whole in this one process), then the
method's `export` (adapters merged, INT8 and NF4 weights dequantized, W = B·A multiplied out), in
the dtype it trained in (bf16-true: bfloat16, the dequantized weights as its forward used them);
and such a model written in Hugging Face format, verified."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from harness.config import RunConfig
from harness.errors import UserError
from harness.methods import build_method
from harness.modifiers.precision import pure_bf16
from harness.trials import CheckpointError, TrialDir, checkpoints, final_model, sharded

Build = Callable[[RunConfig], tuple[nn.Module, Any]]  # a task's (model, tokenizer) builder


def plain_model(run: RunConfig, state: dict[str, Any], build: Build) -> tuple[nn.Module, Any]:
    """(model, tokenizer) as the trainer built them, on the host, `state` (a checkpoint's)
    loaded, then exported by the run's method."""
    model, tok = build(run)
    method = build_method(run)
    model = pure_bf16(method.prepare(pure_bf16(model, run.train), run), run.train)
    if "sharded" in state:  # written shard by shard: the weights alone, each read whole here
        weights = model.state_dict()
        try:
            sharded.load(state["sharded"], "model", weights, state["record"])
        except sharded.Corrupt as e:
            raise UserError(f"checkpoint {state['sharded']}: {e}") from None
        model.load_state_dict(weights)
    else:
        model.load_state_dict(state["model"])
    return pure_bf16(method.export(model), run.train).eval(), tok  # bf16-true: all bf16


def newest_state(trial: TrialDir) -> dict[str, Any]:
    """The trial's newest checkpoint that loads; UserError (one line) when it has none."""
    try:
        found = checkpoints.load_newest(trial.checkpoints)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    if found is None:
        raise UserError(f"{trial}: no final model (model/) and no checkpoint to export from")
    for path, why in found.skipped:
        print(f"warning: {path} does not load ({why}); using {found.path}", file=sys.stderr)
    return found.state


def save_plain(model: nn.Module, tok: Any, folder: Path, step: int, record: bool = True) -> int:
    """`model` and `tok` in Hugging Face format into `folder`, fsynced and verified, with its
    record beside it unless not `record` (trials/final_model.py); returns its bytes."""
    return final_model.write(folder, lambda tmp: save_hf(model, tok, tmp), model.state_dict(),
                             step, record)


def save_hf(model: nn.Module, tok: Any, folder: Path | str) -> None:
    """transformers' `save_pretrained` of `model` (safetensors) and `tok` into `folder`, without
    its progress bar: one line per shard in a trial's log is noise."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
