"""`harness bench report`: how long a report of a large sweep takes, and how much memory.

A sweep of N finished trials is written as the trainer writes one (config.yaml, summary.json,
metrics.jsonl of 1,000 steps logged every 10, an eval every 100), ten methods at 20 learning
rates and N / 200 seeds, and `harness report` runs on it in a child process, whose wall time
and peak resident set are the figures. Target: 2,000 trials in under 15 s (issue 29).
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.trials import write_yaml

TARGET_S = 15.0
METHODS = {"full": {}, "adam8bit": {}, "lora": {"rank": 64}, "relora": {"rank": 64},
           "lowrank": {"rank": 64}, "galore": {"rank": 64}, "apollo": {}, "apollo_mini": {},
           "fira": {"rank": 64}, "muon": {}}  # fmt: skip
LRS = [10 ** (-4 + 2 * i / 19) for i in range(20)]
STEPS = 1000


def write_sweep(root: Path, trials: int) -> None:
    """`trials` finished trials across METHODS × LRS × seeds, with plausible figures."""
    rng = random.Random(0)
    methods = {label: {"name": label, **params} for label, params in METHODS.items()}
    write_yaml(root / "sweep.yaml", {"name": "bench_report", "methods": methods})
    for i in range(trials):
        label = list(METHODS)[i % len(METHODS)]
        lr, seed = LRS[i // len(METHODS) % len(LRS)], i // (len(METHODS) * len(LRS))
        folder = root / "trials" / f"{label}-{i:05d}"
        folder.mkdir(parents=True)
        write_yaml(folder / "config.yaml", {
            "name": "bench_report", "seed": seed, "model": "llama_tiny", "label": label,
            "method": methods[label], "train": {"lr": lr, "steps": STEPS, "batch_size": 8},
            "task": {"kind": "pretrain", "dataset": "sample", "seq_len": 128}})
        ppl = 30 + abs(LRS.index(lr) - 10) + 3 * rng.random() + list(METHODS).index(label)
        (folder / "summary.json").write_text(json.dumps(_summary(folder.name, label, lr, seed,
                                                                 ppl, rng)))
        lines = [{"kind": "train", "step": s, "loss": 5 - s / 400, "lr": lr, "tokens": s * 1024}
                 for s in range(10, STEPS + 1, 10)]
        lines += [{"kind": "eval", "step": s, "tokens": s * 1024, "eval_loss": 3.5,
                   "eval_ppl": ppl * (2 - s / STEPS)} for s in range(100, STEPS + 1, 100)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _summary(trial: str, label: str, lr: float, seed: int, ppl: float,
             rng: random.Random) -> dict[str, Any]:
    return {"trial": trial, "status": "ok", "method": label, "method_name": label,
            "params": METHODS[label], "lr": lr, "seed": seed, "model": "llama_tiny",
            "steps": STEPS, "step": STEPS, "tokens": STEPS * 1024, "eval_loss": 3.4,
            "eval_ppl": ppl, "tokens_per_s": 5000 + 500 * rng.random(), "mfu": None,
            "peak_memory_bytes": int(1e9 * (1 + 0.1 * list(METHODS).index(label))),
            "param_bytes": 40_000_000, "grad_bytes": 40_000_000,
            "optimizer_state_bytes": 80_000_000, "extra_bytes": 0, "wall_s": 200 + rng.random(),
            "device": "cuda:0", "error": None}


def bench_report(trials: int) -> list[dict[str, Any]]:
    """Write the sweep, report it in a child process; its wall time and peak RSS."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "runs"
        write_sweep(root, trials)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "harness.cli", "report", str(root)],
                              capture_output=True, text=True)
        seconds = time.monotonic() - start
        if done.returncode != 0:
            raise RuntimeError(f"harness report failed: {done.stderr.strip()[-500:]}")
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
        pngs = {p.name: p.stat().st_size for p in (root / "report").glob("*.png")}
    return [{"name": f"report/{trials}_trials", "value": round(seconds, 2), "target": TARGET_S,
             "met": seconds < TARGET_S, "peak_rss_bytes": rss, "png_bytes": pngs}]


def report_table(records: list[dict[str, Any]]) -> str:
    lines = []
    for r in records:
        verdict = "met" if r["met"] else "missed"
        figures = ", ".join(f"{n} {b / 1e3:,.0f} kB" for n, b in sorted(r["png_bytes"].items()))
        lines.append(f"{r['name']}: {r['value']:.1f} s (target < {r['target']:g} s: {verdict}), "
                     f"peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB, figures {figures}")
    return "\n".join(lines)
