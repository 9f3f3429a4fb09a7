"""The equality table of docs/scale-out.md: every registered method trained in one process and
under torchrun on 2 and 4 processes with ddp and with fsdp, in 32-true and (2 processes)
bf16-mixed (llama_micro, 6 steps of 8 sequences in micro-batches of 2, so 2 processes
accumulate 2 micro-batches and 4 none; one thread a process). Each cell is a multi-process
run's largest relative difference from the one-process losses (each step's and the final
eval's), and the largest absolute difference of its final weights; or the refusal. One
torchrun launch a column trains every method in turn (tests/train/equality_ranks.py). Run by
hand (about 12 minutes on 2 cores): `python scripts/equality_table.py OUT_DIR [METHOD ...]`
(every registered method, or those named); prints a Markdown table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))
from equality_ranks import measure  # the ranks' own measurement, here on one process
from method_matrix import METHODS  # the matrix's small settings for llama_micro

from harness.errors import UserError
from harness.methods.resolve import load_run

SETTINGS = {"galore": {"update_proj_gap": 3}, "fira": {"update_proj_gap": 3},
            "apollo": {"update_proj_gap": 3}, "apollo_mini": {"update_proj_gap": 3},
            "qgalore": {"update_proj_gap": 3}}  # fmt: skip  (refreshes at steps 1 and 4)
TESTS = Path(__file__).resolve().parents[1] / "tests"
COLUMNS = [("ddp", 2, "32-true"), ("ddp", 4, "32-true"), ("fsdp", 2, "32-true"),
           ("fsdp", 4, "32-true"), ("ddp", 2, "bf16-mixed"), ("fsdp", 2, "bf16-mixed")]


def run_config(method: dict, parallel: str, precision: str) -> dict:
    return {"name": "eq", "model": "llama_micro",
            "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32,
                     "shuffle_buffer": 32},
            "train": {"lr": 0.003, "steps": 6, "batch_size": 2, "total_batch_size": 8,
                      "warmup_steps": 1, "log_every": 1, "parallel": parallel,
                      "precision": precision},
            "eval": {"every": 0, "tokens": 256}, "method": method}  # fmt: skip


def launch(configs: list[Path], procs: int) -> str | None:
    """Every config in one torchrun launch; None when it ended ok, else its last line."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(procs), str(TESTS / "train" / "equality_ranks.py"),
                           *map(str, configs)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(TESTS.parent)})
    return None if done.returncode == 0 else (done.stdout + done.stderr).strip().splitlines()[-1]


def difference(got: dict, ref: dict) -> str:
    losses = max(abs(a - b) / abs(b) for a, b in zip(got["losses"] + [got["eval"]],
                                                      ref["losses"] + [ref["eval"]], strict=True))
    weights = max(float((got["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    return f"{losses:.1e} / {weights:.1e}"


def column(methods: dict[str, dict], parallel: str, procs: int, precision: str,
           root: Path) -> dict[str, str]:
    cells, configs = {}, []
    for name, method in methods.items():
        data = run_config(method, parallel, precision)
        try:
            load_run(data)
        except UserError:
            cells[name] = "refused"
            continue
        path = root / f"{name}-{parallel}-{procs}-{precision}.yaml"
        path.write_text(yaml.safe_dump(data))
        configs.append(path)
    failed = launch(configs, procs) if configs else None
    for path in configs:
        name = path.name.split("-")[0]
        out = path.with_suffix(".pt")
        cells[name] = f"failed: {(failed or '')[:60]}" if not out.exists() else "measured"
    return cells


def main(root: Path, names: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    methods = {n: {**m, **SETTINGS.get(n, {})} for n, m in METHODS.items()
               if not names or n in names}
    refs = {(n, p): measure(load_run(run_config(m, "ddp", p)))
            for n, m in methods.items() for p in ("32-true", "bf16-mixed")}
    cells = {c: column(methods, *c, root) for c in COLUMNS}
    heads = " | ".join(f"{p} {w}{'' if x == '32-true' else ' bf16'}" for p, w, x in COLUMNS)
    print(f"| method | {heads} |\n|---|{'---|' * len(COLUMNS)}")
    for name in methods:
        row = []
        for parallel, procs, precision in COLUMNS:
            cell = cells[(parallel, procs, precision)][name]
            if cell == "measured":
                got = torch.load(root / f"{name}-{parallel}-{procs}-{precision}.pt")
                cell = difference(got, refs[(name, precision)])
            row.append(cell)
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
