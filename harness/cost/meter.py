"""What a trial costs: tokens/s (training only), MFU, peak memory and where the bytes are."""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import psutil
import torch
from torch import nn

from harness.methods.quant import Int8Linear

# Dense peak FLOP/s per device family and precision (vendor datasheets, no sparsity), matched
# as a substring of torch.cuda.get_device_name in this order: the PCIe and NVL parts first, as
# "H100" alone would give them the SXM part's peak (an H100 PCIe also has 80 GB: its MFU would
# read 24% low). "fp32": CUDA cores, not TF32, which torch leaves off for matmuls by default;
# "tf32": the tensor cores' dense TF32 rate (half the datasheets' "with sparsity" figure, half
# the dense bf16 rate), what 32-true's matmuls run at under train.tf32.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12, "tf32": 378e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12, "tf32": 417.5e12},
    "H200 NVL": {"bf16": 835e12, "fp32": 60e12, "tf32": 417.5e12},
    "H200": {"bf16": 989e12, "fp32": 67e12, "tf32": 494.7e12},  # SXM ("NVIDIA H200"), GH200's
    "H100": {"bf16": 989e12, "fp32": 67e12, "tf32": 494.7e12},  # SXM: "NVIDIA H100 80GB HBM3"
    "A100": {"bf16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12, "tf32": 183e12},
    "A10G": {"bf16": 70e12, "fp32": 31.2e12, "tf32": 35e12},
}


# The matmul dtype of each train.precision (16-mixed's fp16 peak equals bf16's on these parts).
MATMUL_DTYPE = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "bf16", "bf16-true": "bf16"}


def peak_flops(device: torch.device, precision: str, tf32: bool | None = None) -> float | None:
    """None where the peak is unknown (every CPU): MFU is then not reported rather than guessed.
    `precision`: a train.precision (or a PEAK_FLOPS key). `tf32`: whether float32 matmuls run
    in TF32 (train.tf32); None: as torch's switch is set in this process (use_tf32 sets it)."""
    if device.type != "cuda":
        return None
    dtype = MATMUL_DTYPE.get(precision, precision)
    if dtype == "fp32" and (torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32):
        dtype = "tf32"
    name = torch.cuda.get_device_name(device)
    for family, peaks in PEAK_FLOPS.items():
        if family in name:
            return peaks.get(dtype)
    return None


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """PaLM's count, split by what backward computes: 6 per trained non-embedding weight
    (forward 2, input gradient 2, weight gradient 2), 4 per frozen one (no weight gradient:
    LoRA's and QLoRA's base), plus attention's 12 * layers * hidden * seq. A tied embedding
    counts: it is the head's matmul too."""
    cfg = model.config
    trained, total = weight_counts(model)
    embedding = model.get_input_embeddings().weight  # a lookup: no FLOPs
    head = model.get_output_embeddings()
    if head is None or head.weight is not embedding:  # tied, it is the head's matmul too
        total -= logical_numel(embedding)
        trained -= logical_numel(embedding) if embedding.requires_grad else 0
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
    return 6 * trained + 4 * (total - trained) + attention


def logical_numel(p: torch.Tensor) -> int:
    """Weights, not storage: a packed 4-bit tensor holds two weights per byte."""
    state = getattr(p, "quant_state", None)
    return state.shape.numel() if state is not None else p.numel()


def weight_counts(model: nn.Module) -> tuple[int, int]:
    """(trained, all) weights, including INT8 weights held as buffers and updated in backward."""
    params = list(model.parameters())
    int8 = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8Linear))
    trained = sum(logical_numel(p) for p in params if p.requires_grad) + int8
    return trained, sum(map(logical_numel, params)) + int8


def current_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def peak_memory(device: torch.device) -> dict[str, int]:
    """The process's peak RSS (one process per trial); CUDA also max allocated and reserved.
    A CPU's peak of live tensors is measured apart (harness/cost/tensor_peak.py `tracked`)."""
    rss = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        return {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
            "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(device),
            **rss,
        }
    return rss


def breakdown(method: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
              grad_bytes: int) -> dict[str, int]:
    """The method's own count of the real tensors, the gradient bytes a GradPeak counted over
    the step (harness/cost/grad_peak.py), and parameter counts."""
    counted = method.measure(model, optimizer)
    trained, total = weight_counts(model)
    return {
        "param_bytes": counted.weight_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": counted.optimizer_state_bytes,
        "extra_bytes": counted.extra_bytes,
        "trainable_params": trained,
        "total_params": total,
    }


class Meter:
    """Training time between marks; the device syncs only when a lap is read (log steps). Each
    counted lap also samples the host's 1-minute load average and the wall-clock span measured,
    so a reader can tell a tok/s measured on a busy or shared machine."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.train_s = 0.0
        self.tokens = 0
        self._mark = time.perf_counter()
        self._lap_tokens = 0
        self._lap_s = 0.0
        self._last = (0.0, 0.0)
        self._loads: list[float] = []
        # wall clock: the first counted lap's start, the last's end
        self._span: tuple[float, float] | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, tokens: int) -> None:
        self._lap_tokens += tokens

    def pause(self) -> None:
        """Close the running interval before eval or a checkpoint, which are not training."""
        self._sync()
        self._lap_s += time.perf_counter() - self._mark

    def resume(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, steady: bool = True) -> tuple[float, float]:
        """(seconds, tokens/s) since the last lap; `steady` counts it toward the trial's tok/s."""
        self.pause()
        if self._lap_tokens == 0:  # nothing since the last lap (the first step was its own)
            self.resume()
            return self._last
        seconds, tokens = self._lap_s, self._lap_tokens
        if steady:
            self.train_s += seconds
            self.tokens += tokens
            self._sample(seconds)
        self._lap_s, self._lap_tokens = 0.0, 0
        self.resume()
        self._last = (seconds, tokens / seconds if seconds > 0 else 0.0)
        return self._last

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.train_s if self.train_s > 0 else None

    def _sample(self, seconds: float) -> None:
        now = time.time()
        self._span = (self._span[0] if self._span else now - seconds, now)
        self._loads.append(os.getloadavg()[0])

    def conditions(self) -> dict[str, float | int | None]:
        """Where tokens_per_s was measured: the mean 1-minute load average over the counted
        laps, the host's CPU count, and the wall-clock span (epoch seconds) of those laps."""
        start, end = self._span or (None, None)
        return {
            "load_average": sum(self._loads) / len(self._loads) if self._loads else None,
            "cpu_count": os.cpu_count(),
            "measured_from": start,
            "measured_to": end,
        }
