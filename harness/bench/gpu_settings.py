"""What every part of the CUDA kit shares (harness/bench/gpu_parts.py, gpu_mfu.py): its sizes
on the device and in the CPU smoke run, and one measured run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.bench.memory import measure_run
from harness.errors import UserError
from harness.methods.resolve import load_run

Record = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    """Sizes for one mode: the GPU measurement, or the CPU smoke run of the same code."""

    device: str
    presets: tuple[str, ...]  # estimate vs max_memory_allocated
    steps: int
    seq_len: int
    batch_size: int
    table11: str  # GaLore Table 11's model
    table11_rows: tuple[str, ...] | None  # TABLE11's labels to run (None: all)
    rank_1b: int
    mfu_batch: int  # the mfu part's micro-batch (the 64 × 256 on a GPU)
    mfu_steps: int  # steps of each mfu run (tok/s leaves out the first)
    tf32_batch: int  # the mfu part's 32-true runs (float32 holds twice the bytes a token)
    gemm_s: float  # the least time each matmul of the GEMM probe is timed for
    loop: tuple[str, int, int, int, str, int]  # model, steps, batch, seq_len, precision, rounds
    big: str  # the 7B single-step part's model
    rank_7b: int
    estimate_labels: tuple[str, ...] | None = None  # bench memory's labels to run (None: all)


GPU = Settings("cuda", ("llama_60m", "llama_350m"), 6, 256, 8, "llama_1b", None, 512,
               64, 8, 16, 0.5, ("llama_350m", 30, 8, 256, "bf16-mixed", 3), "llama_7b", 1024)
# The smoke run: three methods in `estimate` (`harness bench memory` runs every one at the same
# sizes in tests/bench/test_bench.py), two of Table 11's rows (the same loop), every branch of
# the mfu part; small enough for CI's CPUs.
SMOKE = Settings("cpu", ("llama_micro",), 3, 32, 2, "llama_micro",
                 ("full", "galore_8bit_layerwise"), 8, 2, 3, 2, 0.01,
                 ("llama_micro", 3, 2, 32, "32-true", 1), "llama_micro", 8,
                 estimate_labels=("full", "qgalore", "apollo_mini_int8_layerwise"))


def kit_run(s: Settings, model: str, method: dict[str, Any], layerwise: bool = False,
            batch_size: int = 1, steps: int = 3, model_options: dict[str, Any] | None = None,
            **train: Any) -> Any:
    """A short pretraining run at the papers' token batch (batch_size × 256 on a GPU)."""
    return load_run({
        "name": "gpu", "model": model, "device": s.device, "method": method,
        "model_options": model_options or {},
        "task": {"seq_len": 256 if s.device == "cuda" else s.seq_len},
        "train": {"steps": steps, "batch_size": batch_size, "log_every": steps, **train},
        "eval": {"tokens": 256}, "memory": {"layerwise": layerwise},
    })  # fmt: skip


def measured(run: Any) -> Record:
    """Peak of the steady steps, tok/s and MFU of one run; `oom` when it does not fit, and
    `refused` with the harness's one line where this device cannot run it (a CPU and liger)."""
    try:
        results, peak = measure_run(run)
        return {"status": "ok", "peak_bytes": peak, "tokens_per_s": results["tokens_per_s"],
                "mfu": results["mfu"]}
    except torch.OutOfMemoryError as e:  # the next measure_run frees what this one left
        return {"status": "oom", "error": str(e).splitlines()[0]}
    except UserError as e:
        return {"status": "refused", "error": str(e)}
