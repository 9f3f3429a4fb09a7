"""`harness bench syncs`: reads of tensor values by the host inside the training step.

On a GPU each such read (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `nonzero`, ...) waits
for every kernel queued before it, so the host cannot queue the next step's work ahead and the
device idles between steps. A TorchFunctionMode sees every Python-level tensor call, so the
reads are found and located on a CPU too; on CUDA, torch's sync debug mode also counts the
synchronizations made inside C++ kernels. Steps that log, evaluate or save are left out: those
read values by design, every `log_every` steps. Target: none; 16-mixed with an optimizer that has
no fused kernel: one, GradScaler's own overflow check before it calls the optimizer.
"""

from __future__ import annotations

import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor
from torch.overrides import TorchFunctionMode

from harness.bench.memory import METHODS, method_run
from harness.train import Trainer
from harness.train.hooks import Step
from harness.trials import Records

READS = {Tensor.item, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.__index__,
         Tensor.tolist, Tensor.numpy, Tensor.nonzero, torch.nonzero, Tensor.unique, torch.unique,
         torch.masked_select, Tensor.masked_select}
VARIANTS = {  # modifiers and precisions: label -> (METHODS entry, dotted overrides)
    "full+16-mixed": ("full", {"train.precision": "16-mixed"}),
    "galore+16-mixed": ("galore", {"train.precision": "16-mixed"}),
    "full+bf16-mixed": ("full", {"train.precision": "bf16-mixed"}),
    "full+recompute": ("full", {"memory.recompute": "full"}),
    "full+offload": ("full", {"memory.offload": ["mlp"], "memory.offload_min_bytes": 0}),
    "galore+optimizer_offload": ("galore", {"memory.optimizer_offload": "host"}),
    "full+accumulation": ("full", {"train.total_batch_size": 4}),
}  # fmt: skip
EXPECTED = {"galore+16-mixed": 1}  # GradScaler's own overflow check (fused optimizers have none)
WARMUP = 2  # the first steps create states and count costs once


class HostReads(TorchFunctionMode):
    """Counts value reads per call site (the first frame outside torch and this file)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS:
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("bench/syncs.py"):
            return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} {frame.name}"
    return "torch"


def count_reads(run: Any, steps: int) -> tuple[Counter[str], int]:
    """Host reads (by site) and CUDA synchronizations over `steps` steady training steps, each
    with the events `Trainer.fit` fires after it (the stop agreement among them): `run` has
    more than `WARMUP + steps` steps, so none of them is the last, logs, evaluates or saves."""
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(run, Records(Path(out), run), lambda step: False)
        try:
            trainer.model.train()
            for _ in range(WARMUP):
                step(trainer)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
                warnings.simplefilter("always")
                for _ in range(steps):
                    step(trainer)
            return reads.sites, sum("synchroniz" in str(w.message) for w in caught)
        finally:
            if trainer.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            trainer.close()


def step(trainer: Trainer) -> None:
    """One step as `Trainer.fit` runs it: the optimizer step, then its events."""
    loss = trainer.train_step()
    trainer.step += 1
    done = Step(trainer.step, loss, last=trainer.step == trainer.run.train.steps)
    trainer.hooks.fire("step", done)
    trainer.hooks.fire("step_end", done)


def bench_syncs(preset: str, steps: int, seq_len: int, batch_size: int) -> list[dict[str, Any]]:
    """One record per method and variant: host reads per step (`value`), where they are."""
    total = WARMUP + steps + 1  # the last step, which logs, evaluates and saves, not counted
    runs = {label: method_run(label, preset, total, seq_len, batch_size) for label in METHODS}
    runs |= {label: method_run(base, preset, total, seq_len, batch_size, overrides)
             for label, (base, overrides) in VARIANTS.items()}
    records = []
    for label, run in runs.items():
        sites, syncs = count_reads(run, steps)
        records.append({"name": f"syncs/{preset}/{label}",
                        "value": sum(sites.values()) / steps, "target": EXPECTED.get(label, 0),
                        "sites": {s: n / steps for s, n in sites.most_common()},
                        "cuda_syncs_per_step": syncs / steps})
    return records


def syncs_table(records: list[dict[str, Any]]) -> str:
    rows = [[r["name"], f"{r['value']:g}", f"{r['cuda_syncs_per_step']:g}", r["target"],
             "yes" if max(r["value"], r["cuda_syncs_per_step"]) <= r["target"] else "no",
             "; ".join(f"{s} ×{n:g}" for s, n in r["sites"].items())] for r in records]
    return tabulate(rows, headers=["record", "reads/step", "CUDA syncs/step", "target", "met?",
                                   "where"])
