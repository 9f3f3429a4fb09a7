"""What a trial writes to disk, from shapes alone, and whether a sweep's trials fit the disk.

A checkpoint holds the weights, the optimizer states and the method's extras (GaLore's bases,
quantization constants) at the run's widths, all of them under fsdp (each rank its share). Of
the checkpoints a trial writes (every `train.checkpoint_every` steps and at the end) the newest
`train.keep_checkpoints` stay, and while one is saved the one it replaces is still there. The
final model is the base model's parameters at the weights' width (bf16-true: 2 bytes, else 4),
a tied embedding once; the tokenizer's files beside it (t5-base's: 2.4 MB) are not counted.
When the trial ends ok it writes the final model beside its checkpoints, then keeps what
`train.keep_final` says: the model (weights), the model and the checkpoints (full), nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from harness.config import RunConfig, TrainConfig
from harness.methods.memory import MemoryEstimate, Shapes, numel
from harness.methods.widths import widths


def kept_checkpoints(train: TrainConfig) -> int:
    """Checkpoints a trial holds at its end: one every `checkpoint_every` steps and one at the
    end (the last of them when the steps are a multiple), the newest `keep_checkpoints`."""
    return min(written(train), train.keep_checkpoints)


def written(train: TrainConfig) -> int:
    return -(-train.steps // train.checkpoint_every) if train.checkpoint_every else 1


def disk_bytes(run: RunConfig, whole: MemoryEstimate, shapes: Shapes) -> dict[str, int]:
    """One checkpoint's bytes and the kept ones', the final model's (0: `keep_final: none`),
    the most the trial holds at once (a save beside the kept ones, or the final model beside
    them) and what it keeps once it ends."""
    state = whole.weight_bytes + whole.optimizer_state_bytes + whole.extra_bytes
    model = widths(run).weight * sum(numel(s) for s in shapes.values())
    t = run.train
    kept = kept_checkpoints(t) * state
    saving = min(written(t), t.keep_checkpoints + 1) * state
    model = 0 if t.keep_final == "none" else model
    return {"checkpoint_bytes": state, "checkpoints_bytes": kept, "final_model_bytes": model,
            "disk_peak_bytes": max(saving, kept + model),
            "disk_kept_bytes": model + (kept if t.keep_final == "full" else 0)}


def disk_needed(records: list[dict[str, Any]], at_once: int) -> int:
    """Bytes the trials of `records` need on the runs folder's disk: what each keeps once
    ended, plus, for the `at_once` trials that can run together, the most each holds beyond
    that while it runs (the largest such, to be safe)."""
    extra = sorted((r["disk_peak_bytes"] - r["disk_kept_bytes"] for r in records), reverse=True)
    return sum(r["disk_kept_bytes"] for r in records) + sum(extra[:at_once])


def free_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds (or will hold) `folder`."""
    path = folder.resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free
