"""`train.compile`: each decoder layer compiled in place as one graph (fullgraph, as
torchtitan's apply_compile does), after recompute wrapped its modules, so a recomputed layer is
compiled with its checkpoint inside; and the loss's head and cross-entropy. `nn.Module.compile`
keeps the module where it is: state_dict keys, checkpoints and the exported model are those of
the eager model. Parameter hooks (layer-wise updates, the gradient-peak count) run outside the
graphs, as each layer's backward hands its gradients over: one layer's at a time, as eager.

What cannot be traced is refused when the run is loaded (harness/config/run.py, and
methods/resolve.py for methods whose INT8 layers update inside backward)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.config
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from harness.modifiers.recompute import decoder_layers
from harness.trials import RunsDir

CACHE_DIR = "compile_cache"  # inside a sweep's folder, or a lone run's


def targets(model: nn.Module, data: Any) -> dict[str, Callable[..., Any]]:
    """What `train.compile` compiles, by name: each decoder layer and the loss's head."""
    named: dict[str, Callable[..., Any]] = {
        f"layer{i}": layer for i, layer in enumerate(decoder_layers(model))}
    head = getattr(data, "head_loss", None)
    if head is not None:
        named["loss"] = head
    return named


def trace_settings() -> None:
    """Dynamo's settings for these graphs. A layer's forward may set and reset a context
    variable (transformers' hub-kernel wrappers): no net effect, so a checkpoint's recompute
    need not replay it, and a recomputed layer traces as one graph."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def apply(model: nn.Module, data: Any) -> None:
    """Compile each layer in place, and the data's head loss."""
    trace_settings()
    for target in targets(model, data).values():
        if isinstance(target, nn.Module):
            target.compile(fullgraph=True)
        else:  # the function the data's loss calls through its attribute
            data.head_loss = torch.compile(target, fullgraph=True)


def cache_folder(out: Path) -> Path:
    """Where a trial keeps its compiled kernels: its sweep's folder, shared by the sweep's
    trials (on every node of a cluster), or a lone run's own `out`."""
    sweep = RunsDir(out.parent.parent)
    inside = out.parent == sweep.trials and sweep.sweep_yaml.is_file()
    return (sweep.path if inside else out) / CACHE_DIR


def keep_cache(out: Path) -> None:
    """Inductor's and Triton's caches in `cache_folder(out)`, unless the environment names
    folders of its own: a trial then starts from the graphs its sweep compiled before. Set as
    compilation starts (torch reads them there); importing torch sets inductor's to its
    default, which counts as unset."""
    folder = cache_folder(out)
    unset = (None, os.path.abspath(default_cache_dir()))
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in unset:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    if os.environ.get("TRITON_CACHE_DIR") is None:
        os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
