"""`harness bench memory`: the analytic estimator against the bytes a real run holds.

Each method trains a few steps of a preset in this process; its weights, gradients, optimizer
states and extras (projections, quantization constants) are then counted from the real tensors
and compared with `Memory.estimate` on the preset's shapes. Target: equal (ratio 1). The peak of
a steady step (harness/cost/tensor_peak.py: allocated bytes on a GPU, live tensor bytes on the CPU)
is compared with the estimator's, which adds the activation model: target within ±5%.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from harness.config import RunConfig
from harness.cost.activations import activations, peak_bytes
from harness.cost.estimate import vocab_size
from harness.cost.tensor_peak import step_peak
from harness.distributed import pick_device
from harness.methods import build_memory, get_memory, method_names
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import Trainer
from harness.trials import Records

PARTS = {  # summary key -> MemoryEstimate field
    "param_bytes": "weight_bytes",
    "grad_bytes": "grad_bytes",
    "optimizer_state_bytes": "optimizer_state_bytes",
    "extra_bytes": "extra_bytes",
}
def entries() -> dict[str, dict[str, Any]]:
    """Every registered method at its companion's small settings (`Memory.bench`), each
    followed by its variants: the registry is the list, so a method added is benched too."""
    out: dict[str, dict[str, Any]] = {}
    for name in method_names():
        memory = get_memory(name)
        out[name] = dict(memory.bench)
        out.update({label: dict(settings) for label, settings in memory.variants.items()
                    if settings["method"] == name})
    return out


METHODS = entries()  # label -> settings ("method": the registered name, where not the label)
PEAK_TOLERANCE = 0.05


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
    return [record for label in METHODS
            for record in method_records(label, preset, steps, seq_len, batch_size)]


def method_records(label: str, preset: str, steps: int, seq_len: int,
                   batch_size: int) -> list[dict[str, Any]]:
    """One METHODS entry's counted bytes and steady-step peak against its estimate."""
    run = method_run(label, preset, steps, seq_len, batch_size)
    summary, peak = measure_run(run)
    memory = build_memory(run)
    shapes = param_shapes(preset, vocab_size(run.task.tokenizer))
    estimate = memory.estimate(shapes, run)
    acts = activations(run, shapes, memory, pick_device(run.device).type)
    predicted_peak = peak_bytes(estimate, acts, run, shapes)
    records = [_record(f"memory/{preset}/{label}/{key}", summary[key], getattr(estimate, field))
               for key, field in PARTS.items()]
    records.append({**_record(f"memory/{preset}/{label}/peak_bytes", peak, predicted_peak),
                    "tolerance": PEAK_TOLERANCE})
    return records


def _record(name: str, counted: int, predicted: int) -> dict[str, Any]:
    ratio = counted / predicted if predicted else float(counted == 0)
    return {"name": name, "value": counted, "estimate": predicted, "ratio": ratio, "target": 1.0}


def free_memory() -> None:
    """What earlier runs of this process left, freed. A Trainer sits in reference cycles (its
    hooks hold its bound methods, its scheduler a closure over it), so its model, gradients and
    optimizer states go only when the cycle collector runs, which may be well after the next
    run started (seen on CPU with the collector on). On CUDA they would then still be allocated
    and count in that run's `max_memory_allocated`, the peak it is measured by. Then the
    allocator's cached blocks go back, so each run starts from the same reserved memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Unsaved(Records):
    """A measured run's folder, deleted when it ends: the final checkpoint no one would read
    is not written. On a device it would cost a part's cap minutes: LLaMA-1B under AdamW is
    13.5 GB serialized, hashed and fsynced per run, after the steps measured, so no figure
    changes."""

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        return None


def measure_run(run: RunConfig) -> tuple[dict[str, Any], int]:
    """The trial's results (tok/s, MFU, counted bytes), and the peak of its steady steps."""
    free_memory()  # before: a run that raised (an OOM) is freed too, once its caller let go
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, _Unsaved(Path(out), run), lambda step: False)
        try:
            peak, _ = step_peak(trainer)
            return trainer.results(), peak
        finally:
            trainer.close()


def met(record: dict[str, Any]) -> bool:
    """Exact, or within the record's tolerance of its target ratio."""
    tolerance = record.get("tolerance")
    if tolerance is None:
        return record["value"] == record["estimate"]
    return abs(record["ratio"] - record["target"]) <= tolerance


def memory_table(records: list[dict[str, Any]]) -> str:
    rows = [[r["name"], f"{r['value']:,}", f"{r['estimate']:,}", f"{r['ratio']:.4f}",
             f"{r['target']} ± {r['tolerance']}" if "tolerance" in r else "exact",
             "yes" if met(r) else "no"] for r in records]  # fmt: skip
    return tabulate(rows, headers=["record", "measured", "estimated", "ratio", "target", "met?"])
