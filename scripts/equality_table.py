"""The equality table of docs/scale-out.md: every registered method trained in one process and
under torchrun on 2 and 4 processes with ddp and with fsdp (llama_micro, 6 steps of 8 sequences
in micro-batches of 2, one thread a process), each multi-process run's largest relative
difference from the one-process losses (train and eval), or the refusal. Run by hand (about
15 minutes on 2 cores): `python scripts/equality_table.py OUT_DIR [METHOD ...]` (every
registered method, or those named); prints a Markdown table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from method_matrix import METHODS  # the matrix's small settings for llama_micro

from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.trials import read_jsonl

SETTINGS = {"galore": {"update_proj_gap": 3}, "fira": {"update_proj_gap": 3},
            "apollo": {"update_proj_gap": 3}, "apollo_mini": {"update_proj_gap": 3},
            "qgalore": {"update_proj_gap": 3}}  # fmt: skip  (refreshes at steps 1 and 4)


def run_config(method: dict, parallel: str) -> dict:
    return {"name": "eq", "model": "llama_micro",
            "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32,
                     "shuffle_buffer": 32},
            "train": {"lr": 0.003, "steps": 6, "batch_size": 2, "total_batch_size": 8,
                      "warmup_steps": 1, "log_every": 1, "parallel": parallel},
            "eval": {"every": 3, "tokens": 256}, "method": method}  # fmt: skip


def losses(out: Path) -> list[float]:
    return [r.get("loss", r.get("eval_loss")) for r in read_jsonl(out / "metrics.jsonl")
            if r["kind"] in ("train", "eval")]


def train(config: Path, out: Path, procs: int) -> str | None:
    """None when the run ended ok; else its last line."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs)]
              if procs > 1 else [sys.executable])
    done = subprocess.run([*launch, "-m", "harness.cli", "train", str(config), "--out", str(out)],
                          capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return None if done.returncode == 0 else (done.stdout + done.stderr).strip().splitlines()[-1]


def cell(method: dict, parallel: str, procs: int, reference: list[float], root: Path) -> str:
    data = run_config(method, parallel)
    try:
        load_run(data)
    except UserError:
        return "refused"
    out = root / f"{method['name']}-{parallel}-{procs}"
    config = root / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(data))
    failed = train(config, out, procs)
    if failed:
        return f"failed: {failed[:60]}"
    got = losses(out)
    if len(got) != len(reference):
        return "different steps"
    return f"{max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True)):.1e}"


def main(root: Path, names: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    print("| method | ddp 2 | ddp 4 | fsdp 2 | fsdp 4 |\n|---|---|---|---|---|", flush=True)
    for name, method in METHODS.items():
        if names and name not in names:
            continue
        method = {**method, **SETTINGS.get(name, {})}
        config = root / f"{name}-1.yaml"
        config.write_text(yaml.safe_dump(run_config(method, "ddp")))
        failed = train(config, root / f"{name}-1", 1)
        if failed:
            print(f"| {name} | one process failed: {failed[:60]} |||", flush=True)
            continue
        reference = losses(root / f"{name}-1")
        cells = [cell(method, parallel, procs, reference, root)
                 for parallel in ("ddp", "fsdp") for procs in (2, 4)]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
