"""`harness bench gpu`: every claim the harness makes about CUDA, measured by one command.

A lent device comes rarely, for about 30 minutes, 10 minutes a command. So the parts run in
priority order (harness/bench/gpu_parts.py), each in its own process under its own time cap (a
hang or a crash costs that part alone), and one starts only if its cap fits in what is left of
`--budget-min`. After each part, OUT/gpu.json (every figure, with the machine, the versions and
the command that measured it) and OUT/gpu.md (the tables) are rewritten; run again with the same
OUT, the kit goes on with the parts not yet done. `--smoke` runs the same code on the CPU at
llama_micro, so CI keeps the kit working between devices.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from harness.bench.gpu_report import render
from harness.errors import UserError
from harness.trials import atomic_write, read_json, write_json

# Minutes each part may take. Every cap fits one 10-minute command on the device with the
# start-up around it; estimated from the CPU timings and the target GPU's speed (docs/bench.md).
CAPS = {"tests": 8.0, "estimate": 8.0, "table11": 8.0, "mfu": 9.0, "loop": 4.0, "llama7b": 8.0}
SMOKE_CAP = 3.0  # each part's cap in a smoke run (mfu, the longest, compiles llama_micro)
EXIT_LEFT = 3  # parts left for the next run, as `harness sweep` exits with trials left


def environment(smoke: bool) -> dict[str, Any]:
    """The machine and versions, read without a CUDA context (the parts need all the memory)."""
    gpu: dict[str, Any] = {"gpu": None, "driver": None, "gpu_memory": None}
    if not smoke:
        try:
            line = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=60,
            ).stdout.splitlines()[0]
            gpu = dict(zip(gpu, (x.strip() for x in line.split(",")), strict=False))
        except (OSError, IndexError, subprocess.TimeoutExpired):
            pass
    versions = {}
    for package in ("torch", "bitsandbytes", "transformers", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {**gpu, "cuda": torch.version.cuda, **versions, "python": sys.version.split()[0],
            "smoke": smoke, "command": shlex.join(["harness", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def load_state(out: Path, smoke: bool) -> dict[str, Any]:
    """gpu.json: {"smoke", "environment" (of the latest run), "parts": {name: part}}, each part
    with its status, seconds, records and the environment and command that measured it."""
    state = read_json(out / "gpu.json")
    if state is None:
        return {"smoke": smoke, "environment": None, "parts": {}}
    if state.get("smoke") != smoke:
        was, now = ("--smoke", "a GPU run") if state.get("smoke") else ("a GPU run", "--smoke")
        raise UserError(f"--out {out}: holds {was}'s figures; {now} needs another folder")
    return state


def run_part(name: str, out: Path, cap_s: float, smoke: bool) -> dict[str, Any]:
    """One part in its own process, killed at its cap; what it measured by then is kept."""
    log, records = out / f"{name}.log", out / f"{name}.jsonl"
    records.unlink(missing_ok=True)
    command = [sys.executable, "-m", "harness.bench.gpu_parts", name, str(out)]
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen([*command, *(["--smoke"] if smoke else [])], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=cap_s) == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    part: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - start, 1),
                            "cap_s": cap_s, "environment": environment(smoke)}
    part["records"] = ([json.loads(line) for line in records.read_text().splitlines()]
                       if records.exists() else [])
    if status != "ok":
        part["error"] = log.read_text()[-3000:]
    records.unlink(missing_ok=True)
    log.unlink()
    return part


def bench_gpu(out: Path, budget_min: float, smoke: bool, parts: list[str] | None = None,
              cap_min: float | None = None) -> tuple[str, int]:
    """Run the parts not yet done that the budget holds; (what to print, exit status).

    `parts` and `cap_min` fit the kit to a shorter lease than its caps were sized for: parts
    that measure memory alone can then run side by side, each in its own --out."""
    unknown = sorted(set(parts or []) - set(CAPS))
    if unknown:
        raise UserError(f"bench gpu --parts: no part {', '.join(unknown)}; "
                        f"the parts are {', '.join(CAPS)}")
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out, smoke)
    state["environment"] = environment(smoke)
    start, lines, left = time.monotonic(), [], []
    for name, cap in CAPS.items():
        if parts is not None and name not in parts:
            continue
        cap_s = (cap_min or (SMOKE_CAP if smoke else cap)) * 60
        if name in state["parts"]:
            lines.append(f"{name}: done before ({state['parts'][name]['status']})")
            continue
        if cap_s > budget_min * 60 - (time.monotonic() - start):
            left.append(name)
            lines.append(f"{name}: not started, its {cap_s / 60:g}-minute cap is more than the "
                         "budget has left")
            continue
        print(f"{name}: running (at most {cap_s / 60:g} minutes)", flush=True)
        part = state["parts"][name] = run_part(name, out, cap_s, smoke)
        _write(out, state)
        lines.append(f"{name}: {part['status']} in {part['seconds']:g} s")
    _write(out, state)
    if left:
        lines.append(f"left for the next run with --out {out}: {', '.join(left)}")
    return "\n".join(lines), (EXIT_LEFT if left else 0)


def _write(out: Path, state: dict[str, Any]) -> None:
    write_json(out / "gpu.json", state)
    atomic_write(out / "gpu.md", render(state))
