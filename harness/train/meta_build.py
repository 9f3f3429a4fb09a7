"""A trial's model built on the meta device for fsdp (harness/distributed/materialize.py), by
where it comes from: drawn from the seed (a preset, an HF config without weights, a preset's
GLUE classifier), or a skeleton that draws nothing filled with this rank's rows of its weight
files (a local folder's or a cached hub model's, safetensors or `.bin`), a GLUE classifier's
new head then drawn as from_pretrained draws it. Each is bitwise the ordinary build, the
generator left where that build leaves it; where it cannot be, `Unsupported` says why."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.config import ModelFrom, RunConfig
from harness.data.glue import get_task
from harness.distributed.materialize import Twins, Unsupported
from harness.distributed.weights import Weights, hub_folder, weight_files
from harness.models import PRESETS, hf_model
from harness.train import classifier, pretrain

Built = tuple[nn.Module, Any]  # (model, tokenizer)


def build(run: RunConfig, twins: Twins, whole: Callable[[], Built]) -> Built:
    """`run`'s model on the meta device under `twins`, as `whole` (the ordinary build) would
    build it; `Unsupported` where it cannot be."""
    if run.task.kind == "glue":
        if not isinstance(run.model, ModelFrom) and run.model in PRESETS:
            return twins.run(whole)
        load = partial(pretrained, twins)
        return classifier.build_classifier(run, get_task(run.task.glue_task).num_labels, load)
    if run.model in PRESETS or hf_model(run.model).weights is None:
        return twins.run(whole)
    weights = Weights(files_of(hf_model(run.model).weights or ""))
    built, tok = twins.run(partial(pretrain.build, run, skeleton=True), draw=False)
    twins.read_rows(built, weights)  # from_pretrained draws nothing: neither did the skeleton
    return built, tok


def files_of(name: str) -> list[Path]:
    """The weight files of a local folder, or of a hub model's snapshot in the local cache (at
    the revision from_pretrained reads: where it lacks them, the ordinary build downloads)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        files = weight_files(folder)
        if files is None:
            raise Unsupported(f"no weight files from_pretrained reads in {folder}")
        return files
    cached = hub_folder(name)
    files = None if cached is None else weight_files(cached)
    if files is None:
        raise Unsupported(f"the weights of '{name}' are not in the local Hugging Face cache")
    return files


def pretrained(twins: Twins, name: str, config: Any) -> nn.Module:
    """AutoModelForSequenceClassification.from_pretrained(name, config) on the meta device:
    its skeleton in the dtype from_pretrained picks, drawing nothing (from_pretrained builds
    on the meta device too); the weights the files hold read by rows and marked loaded; then
    from_pretrained's own initialization of what they lack (the head), drawn on the twins."""
    from transformers import AutoModelForSequenceClassification

    weights = Weights(files_of(name))
    dtype = _auto_dtype(config, weights)

    def skeleton() -> nn.Module:
        with torch.device("meta"):
            return AutoModelForSequenceClassification.from_config(config, dtype=dtype)

    model = twins.run(skeleton, draw=False)
    base = f"{model.base_model_prefix}."
    head = {n for n, _ in model.named_parameters() if not n.startswith(base)}
    read = twins.read_rows(model, weights, fresh=head)
    for key in read:  # as from_pretrained flags what it loaded: its init then skips them
        model.get_parameter_or_buffer(key)._is_hf_initialized = True
    model.mark_tied_weights_as_initialized(None)

    def initialize() -> None:
        model._initialize_missing_keys(is_quantized=False)
        model.tie_weights(missing_keys=head - read, recompute_mapping=False)

    twins.run(initialize)
    return model.eval()


def _auto_dtype(config: Any, weights: Weights) -> torch.dtype:
    """from_pretrained's `dtype="auto"`: the config's, else the files' floating dtype."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or weights.floating_dtype()
    if dtype is None:
        raise Unsupported("the files hold several floating dtypes and the config names none")
    return dtype
