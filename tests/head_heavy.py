"""A step's measured and estimated peak where the update's float32 temporaries show: a LLaMA
whose 8192 × 256 head and embedding are most of it, 1 × 16 tokens, for a method's
`Memory.update_bytes` (tests/cost/test_activations.py, tests/methods/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import SAMPLE_VOCAB, estimated_peak, measured_peak

from harness.bench.memory import method_run
from harness.config import RunConfig

# measured within 0.0001 for MARS and Stable-SPAM in every precision; the generic test's bound
PEAK_RTOL = 0.005


def head_heavy_run(tmp_path: Path, method: str, overrides: dict[str, Any], hidden: int = 256,
                   intermediate: int = 688) -> RunConfig:
    """3 steps of `method` on CPU on a one-layer LLaMA of `hidden` (its head and embedding
    8192 × hidden) and `intermediate` MLP width, bf16-true unless `overrides` (dotted keys)
    say otherwise."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=SAMPLE_VOCAB, rms_norm_eps=1e-6,
                ).save_pretrained(tmp_path / "head_heavy")
    return method_run(method, str(tmp_path / "head_heavy"), 3, 16, 1,
                      {"device": "cpu", "train.precision": "bf16-true", **overrides})


def head_heavy_peaks(tmp_path: Path, method: str, overrides: dict[str, Any]) -> tuple[int, int]:
    """(measured, estimated) peak bytes of `head_heavy_run`."""
    run = head_heavy_run(tmp_path, method, overrides)
    measured, _ = measured_peak(run)
    return measured, estimated_peak(run)
