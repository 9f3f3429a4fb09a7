"""`harness bench fsdp`: each rank's peak memory, the bytes it sends and the step time of one
trial under DDP, FSDP2 and HSDP, at each process count asked for.

The same trial (model, data, global batch of `batch_size` sequences a process, steps) runs
under torchrun with `train.parallel` ddp, fsdp and hsdp (two replica groups, sharded within
each: on 4 processes 2 x 2, on 2 processes 2 x 1), in alternating rounds so that drift in the
machine's speed falls on each; one process is the same trial whatever the strategy, run once a
round. Each rank (harness/bench/fsdp_rank.py) records its peak of live tensors in step 3 (CPU;
the trial's own `peak_memory_bytes`), the median seconds of steps 5 on but the last, the bytes
it sends in one steady step's collectives, counted as they run (harness/bench/comm.py). On CPU
the times have no target (gloo's collectives are slow and nothing overlaps); the bytes and
peaks are what a GPU run holds and sends too, up to CUDA's workspaces.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.config.metrics import human_bytes
from harness.errors import UserError
from harness.trials import write_yaml

PARALLEL = ("ddp", "fsdp", "hsdp")
MIN_STEPS = 6  # the peak's step 3, the step its profiler hands over, a timed one, the last


def layouts(procs: list[int], parallel: list[str]) -> list[tuple[str, int]]:
    """(strategy, processes) to run: one process once (every strategy is the same trial)."""
    return [("single", 1)] * (1 in procs) + [(p, n) for n in procs if n > 1 for p in parallel]


def bench_fsdp(model: str, steps: int, batch_size: int, seq_len: int, procs: list[int],
               rounds: int, parallel: list[str] | None = None) -> list[dict[str, Any]]:
    """One record per strategy and process count: its median step seconds over the rounds, its
    ranks' peaks and sent bytes (the first round's: the same every round)."""
    if steps < MIN_STEPS:
        raise UserError(f"--steps {steps}: bench fsdp times steps 5 on (after its peak's step "
                        f"3 and the next) but the last; use --steps {MIN_STEPS} or more")
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for strategy, n in layouts(procs, list(parallel or PARALLEL)):
                out = Path(tmp) / f"{strategy}-{n}-{r}"
                config = out.with_suffix(".yaml")
                write_yaml(config, _config(model, steps, batch_size, seq_len, n, strategy))
                runs.setdefault((strategy, n), []).append(_run(config, out, n))
    return [_record(strategy, n, done, model) for (strategy, n), done in runs.items()]


def _record(strategy: str, procs: int, done: list[dict[str, Any]], model: str) -> dict[str, Any]:
    first = done[0]
    step_s = statistics.median(d["step_s"] for d in done)
    return {"name": f"fsdp/{strategy}-{procs}", "parallel": strategy, "procs": procs,
            "shard_group": first["shards"], "value": step_s, "unit": "s", "target": None,
            "per_round": [d["step_s"] for d in done], "tokens_per_s": first["tokens"] / step_s,
            "peak_bytes": [r["peak_bytes"] for r in first["ranks"]],
            "sent_bytes": [r["sent_bytes"] for r in first["ranks"]],
            "payload_bytes": first["ranks"][0]["payload_bytes"],
            "param_bytes": [r["param_bytes"] for r in first["ranks"]], "model": model}


def _config(model: str, steps: int, batch_size: int, seq_len: int, procs: int,
            parallel: str) -> dict[str, Any]:
    sharding = {"parallel": parallel} if parallel != "single" else {}
    if parallel == "hsdp":  # two replica groups, as two nodes
        sharding["shard_group"] = max(1, procs // 2)
    return {
        "name": f"bench_fsdp_{parallel}", "model": model, "device": "auto",
        "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": seq_len},
        "train": {"steps": steps, "batch_size": batch_size,
                  "total_batch_size": batch_size * procs, "log_every": steps, **sharding},
        "eval": {"tokens": seq_len},
        "method": {"name": "full"},
    }  # fmt: skip


def _run(config: Path, out: Path, procs: int, tries: int = 2) -> dict[str, Any]:
    """One trial under torchrun, each process on its share of the CPUs; rank 0's figures. A
    trial that fails is run once more (torchrun's standalone rendezvous picks a free port that
    another program may take first); its output's tail goes to stderr."""
    threads = max(1, len(os.sched_getaffinity(0)) // procs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(procs), "-m", "harness.bench.fsdp_rank", str(config), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    figures = out / "bench.json"
    if not done.returncode and figures.exists():
        return json.loads(figures.read_text())
    lines = (done.stderr or done.stdout).strip().splitlines()
    print("\n".join(lines[-40:]), file=sys.stderr, flush=True)
    if tries > 1:  # into a folder of its own: the failed one may hold a checkpoint
        return _run(config, out.with_name(f"{out.name}-again"), procs, tries - 1)
    said = [line for line in lines if re.search(r"\w+(Error|Exception): ", line)]
    raise UserError(f"bench fsdp: the {out.name} trial did not finish "
                    f"({(said or lines or ['no output'])[-1]})")


def _span(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]  # a peak the profiler failed to read: None
    if not known:
        return "—"
    low, high = min(known), max(known)
    return human_bytes(low) if low == high else f"{human_bytes(low)} to {human_bytes(high)}"


def fsdp_table(records: list[dict[str, Any]]) -> str:
    """A row per strategy and process count: step seconds (each round's), tokens/s, the
    ranks' peaks, weights and sent bytes a step, and the step time against DDP's."""
    ddp = {r["procs"]: r["value"] for r in records if r["parallel"] in ("ddp", "single")}
    rows = []
    for r in records:
        shape = f" {r['procs'] // r['shard_group']}x{r['shard_group']}" \
            if r["parallel"] == "hsdp" else ""
        base = ddp.get(r["procs"])
        rows.append([f"{r['parallel']}{shape}", r["procs"], f"{r['value']:.3f}",
                     " ".join(f"{v:.3f}" for v in r["per_round"]), f"{r['tokens_per_s']:,.0f}",
                     _span(r["peak_bytes"]), _span(r["param_bytes"]), _span(r["sent_bytes"]),
                     f"{r['value'] / base:.2f}" if base else "—"])
    headers = ["parallel", "procs", "step s", "rounds", "tok/s", "peak a rank", "weights a rank",
               "sent a rank a step", "step / ddp"]
    model = records[0]["model"] if records else ""
    return (f"{tabulate(rows, headers=headers, disable_numparse=True)}\n\n{model}, full AdamW; "
            "sent: ring bytes of every collective in one steady step (no target on CPU)")
