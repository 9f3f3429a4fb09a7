"""Kernels the model runs instead of torch's defaults, each switched on alone: liger-kernel's
fused Triton kernels (`model_options.kernels: liger`: RMSNorm, SwiGLU, RoPE; its fused linear
cross-entropy is the pretraining loss's, `liger_linear_cross_entropy`) and TF32 matmuls under
32-true (`train.tf32`). With neither, the model and torch's settings stay as built."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from harness.config import RunConfig, TrainConfig
from harness.data.loader import IGNORE
from harness.errors import UserError

# What liger patches in the built model: the elementwise work. Its fused linear cross-entropy
# is the loss's to call (it replaces the head's matmul and the cross-entropy, which the model's
# forward does not run); its plain cross-entropy would then be unused.
LIGER_PATCHES = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}
NEEDS = ("triton", "liger_kernel")  # importable, in this order: liger imports triton


def liger_missing() -> str | None:
    """Why liger's kernels cannot run in this process, None where they can."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    for module in NEEDS:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable"
    return None


def liger_available() -> bool:
    return liger_missing() is None


def check_liger() -> None:
    """One line where liger cannot run here (the trial's start: its device is known)."""
    reason = liger_missing()
    if reason is not None:
        raise UserError(f"model_options.kernels: liger runs Triton kernels on CUDA, and here "
                        f"{reason}; install the extra on a CUDA machine (pip install "
                        "'.[kernels]'), or use kernels: torch")


def use_liger(model: nn.Module) -> nn.Module:
    """liger's RMSNorm, SwiGLU MLP and RoPE in `model`, patched in place (its modules keep
    their weights and names, so methods that replace linears still find them). RoPE is
    patched in the model type's module, process-wide: a trial's process builds one model."""
    check_liger()
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type, known = model.config.model_type, sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)
    if model_type not in known:
        raise UserError(f"model_options.kernels: liger has no kernels for model type "
                        f"'{model_type}'; allowed: {', '.join(known)}, or kernels: torch")
    _apply_liger_kernel_to_instance(model=model, **LIGER_PATCHES)
    return model


LinearLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def liger_linear_cross_entropy() -> LinearLoss:
    """liger's fused linear cross-entropy as the pretraining loss takes it: (hidden states
    [tokens, hidden], the head's weight [vocab, hidden], targets [tokens], IGNORE where none)
    -> the summed loss; the logits are computed a chunk at a time and never kept whole."""
    check_liger()
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    return lambda hidden, weight, targets: loss(weight, hidden, targets)


def use_tf32(train: TrainConfig) -> None:
    """train.tf32: CUDA's float32 matmuls (cuBLAS, cuDNN) in TF32 for the rest of the process,
    the trial's. Only CUDA's switches, and only where CUDA is: a CPU run's matmuls, which have
    no TF32, stay as they are (torch's global precision switch would also change oneDNN's)."""
    if train.tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def use_kernels(model: nn.Module, run: RunConfig) -> nn.Module:
    """The built model with the run's kernels: liger's where model_options ask, TF32 matmuls
    where train.tf32 does."""
    use_tf32(run.train)
    return use_liger(model) if run.model_options.kernels == "liger" else model
