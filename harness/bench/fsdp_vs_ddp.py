"""`harness bench fsdp`: tokens/s of FSDP2 against DDP at the same world size.

The same trial (model, data, global batch, steps) runs under torchrun with `train.parallel`
ddp and fsdp, in alternating rounds so that drift in the machine's speed falls on both; each
run's steady tokens/s is the trial's own (its summary, first step left out). The figure is the
ratio of the medians, fsdp over ddp. On CPU it has no target (gloo's all-gathers are slow and
nothing overlaps); on GPUs it belongs to the CUDA kit.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.errors import UserError
from harness.trials import TrialDir, write_yaml

PARALLEL = ("ddp", "fsdp")


def bench_fsdp(model: str, steps: int, batch_size: int, seq_len: int, procs: int,
               rounds: int) -> list[dict[str, Any]]:
    """Per strategy its tokens/s each round and their median; then the ratio fsdp / ddp."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PARALLEL}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for parallel in PARALLEL:
                out = Path(tmp) / f"{parallel}-{r}"
                write_yaml(out.with_suffix(".yaml"),
                           _config(model, steps, batch_size, seq_len, procs, parallel))
                runs[parallel].append(_run(out.with_suffix(".yaml"), out, procs))
    records = [{"name": f"fsdp/{p}_tokens_per_s",
                "value": statistics.median(r["tokens_per_s"] for r in runs[p]), "unit": "tok/s",
                "target": None, "per_round": [r["tokens_per_s"] for r in runs[p]],
                "param_bytes": runs[p][0]["param_bytes"]} for p in PARALLEL]
    ratio = records[1]["value"] / records[0]["value"]
    return [*records, {"name": "fsdp/ratio", "value": ratio, "unit": "x", "target": None,
                       "procs": procs, "model": model}]


def _config(model: str, steps: int, batch_size: int, seq_len: int, procs: int,
            parallel: str) -> dict[str, Any]:
    return {
        "name": f"bench_fsdp_{parallel}", "model": model, "device": "auto",
        "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": seq_len},
        "train": {"steps": steps, "batch_size": batch_size,
                  "total_batch_size": batch_size * procs, "log_every": steps,
                  "parallel": parallel},
        "eval": {"tokens": seq_len},
        "method": {"name": "full"},
    }  # fmt: skip


def _run(config: Path, out: Path, procs: int) -> dict[str, Any]:
    """One trial under torchrun, each process on its share of the CPUs; its summary."""
    threads = max(1, len(os.sched_getaffinity(0)) // procs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(procs), "-m", "harness.cli", "train", str(config), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    summary = TrialDir(out).read_summary()
    if done.returncode or summary is None or summary.status != "ok":
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"bench fsdp: the {out.name} trial did not finish ({tail[0]})")
    return summary.to_dict()


def fsdp_table(records: list[dict[str, Any]]) -> str:
    *runs, ratio = records
    rows = [[r["name"].removeprefix("fsdp/").removesuffix("_tokens_per_s"), f"{r['value']:,.0f}",
             " ".join(f"{v:,.0f}" for v in r["per_round"]), f"{r['param_bytes']:,}"]
            for r in runs]
    table = tabulate(rows, headers=["parallel", "tok/s (median)", "rounds", "rank 0 weights B"],
                     disable_numparse=True)
    return (f"{table}\n\nfsdp / ddp tokens/s on {ratio['procs']} processes, {ratio['model']}: "
            f"{ratio['value']:.3f} (no target on CPU)")
