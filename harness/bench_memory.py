"""`harness bench memory`: the analytic estimator against the bytes a real run holds.

Each method trains a few steps of a preset in this process; its weights, gradients, optimizer
states and extras (projections, quantization constants) are then counted from the real tensors
and compared with `Method.estimate` on the preset's shapes. Target: equal (ratio 1). On CUDA
each method's peak allocated memory (statistics reset before it) is reported as a value
without a target: the estimator does not model activations. On CPU there is no per-method
peak to report: all methods share this process, whose peak RSS only grows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from harness.config import RunConfig, load_run
from harness.estimate import vocab_size
from harness.methods import build_method
from harness.models import param_shapes
from harness.records import Records
from harness.train import Trainer

PARTS = {  # summary key -> MemoryEstimate field
    "param_bytes": "weight_bytes",
    "grad_bytes": "grad_bytes",
    "optimizer_state_bytes": "optimizer_state_bytes",
    "extra_bytes": "extra_bytes",
}
METHODS = {  # one small setting each, so every method runs on any preset
    "full": {}, "adam8bit": {}, "lora": {"rank": 8}, "relora": {"rank": 8},
    "qlora": {"rank": 8}, "lowrank": {"rank": 16}, "galore": {"rank": 16},
    "galore_8bit_layerwise": {"method": "galore", "rank": 16, "optimizer": "adam8bit"},
    "qgalore": {"rank": 16},
}  # fmt: skip


def method_run(label: str, preset: str, steps: int, seq_len: int, batch_size: int,
               overrides: dict[str, Any] | None = None) -> RunConfig:
    """A short run of one METHODS entry on `preset`; `overrides` are dotted keys (--set's)."""
    params = METHODS[label]
    name = params.get("method", label)
    method = {"name": name, **{k: v for k, v in params.items() if k != "method"}}
    return load_run({
        "name": "bench", "model": preset, "device": "auto", "method": method,
        "task": {"seq_len": seq_len},
        "train": {"steps": steps, "batch_size": batch_size, "log_every": steps},
        "eval": {"tokens": seq_len},
        "memory": {"layerwise": label.endswith("layerwise")},
    }, overrides)  # fmt: skip


def bench_memory(preset: str, steps: int, seq_len: int, batch_size: int) -> list[dict[str, Any]]:
    records = []
    for label in METHODS:
        run = method_run(label, preset, steps, seq_len, batch_size)
        summary = _measure(run)
        estimate = build_method(run).estimate(
            param_shapes(preset, vocab_size(run.task.tokenizer), seq_len), run)
        for key, field in PARTS.items():
            predicted, counted = getattr(estimate, field), summary[key]
            records.append({"name": f"memory/{preset}/{label}/{key}", "value": counted,
                            "estimate": predicted,
                            "ratio": counted / predicted if predicted else float(counted == 0),
                            "target": 1.0})
        if torch.cuda.is_available():
            records.append({"name": f"memory/{preset}/{label}/peak_memory_bytes",
                            "value": summary["peak_memory_bytes"], "target": None})
    return records


def _measure(run: Any) -> dict[str, Any]:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, Records(Path(out), run), lambda step: False)
        try:
            trainer.fit()
            return trainer.results()
        finally:
            trainer.close()


def memory_table(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        met = "" if r["target"] is None else ("exact" if r["value"] == r["estimate"] else "off")
        rows.append([r["name"], f"{r['value']:,}", f"{r.get('estimate', ''):,}"
                     if "estimate" in r else "", f"{r['ratio']:.4f}" if "ratio" in r else "",
                     r["target"] or "", met])
    return tabulate(rows, headers=["record", "measured", "estimated", "ratio", "target", "met?"])
