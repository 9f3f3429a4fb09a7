"""The run directory: config, metrics, summary and checkpoint, each written atomically."""

from __future__ import annotations

import json
import os
import platform
import random
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from harness.config import RunConfig
from harness.errors import UserError

LIBRARIES = ("torch", "transformers", "bitsandbytes", "datasets", "tokenizers", "harness")


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write-then-rename, so a crash never leaves a half-written file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """None for a file that is missing, half-written or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_yaml(path: Path, obj: Any) -> None:
    atomic_write(path, yaml.safe_dump(obj, sort_keys=False))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole record; a line cut short by a crash or a concurrent write is skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            rows.append(record)
    return rows


def provenance() -> dict[str, Any]:
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        commit = done.stdout.strip() if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "git_commit": commit,
        "python": platform.python_version(),
        "host": platform.node(),
        "versions": versions,
    }


class Records:
    """One trial's folder: `config.yaml`, `metrics.jsonl`, `summary.json`, `checkpoint/`."""

    def __init__(self, out: Path, run: RunConfig) -> None:
        self.out = Path(out)
        self.run = run
        self.metrics_path = self.out / "metrics.jsonl"
        self.summary_path = self.out / "summary.json"
        self.ckpt_path = self.out / "checkpoint" / "state.pt"
        self.wandb: Any = None

    def write_config(self) -> None:
        data = self.run.model_dump(by_alias=True)
        data["provenance"] = provenance()
        write_yaml(self.out / "config.yaml", data)

    def summary(self) -> dict[str, Any] | None:
        return read_json(self.summary_path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json(self.summary_path, summary)

    def log(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in row.items() if k not in ("kind", "step")}, step=row["step"]
            )

    def truncate_metrics(self, step: int) -> None:
        """On resume, drop what was logged after the checkpoint: it will be logged again."""
        rows = [r for r in read_jsonl(self.metrics_path) if r.get("step", 0) <= step]
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt_path.with_name(".state.pt.tmp")
        torch.save({**state, "identity": self.run.identity()}, tmp)
        os.replace(tmp, self.ckpt_path)

    def load_checkpoint(self) -> dict[str, Any] | None:
        if not self.ckpt_path.exists():
            return None
        state = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
        if state.get("identity") != self.run.identity():
            raise UserError(
                f"{self.ckpt_path}: written by a different config ({state.get('identity')}, "
                f"this run is {self.run.identity()}); use another --out or delete that folder"
            )
        return state

    def start_wandb(self) -> None:
        """Offline by default: the run syncs later with `wandb sync`, nothing needs the network."""
        cfg = self.run.wandb
        if not cfg.enabled:
            return
        import wandb

        self.wandb = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(self.out),
            group=self.run.name,
            name=self.out.name,
            id=f"{self.run.name}-{self.out.name}",
            config=self.run.model_dump(),
            resume="allow",
            reinit="finish_previous",
        )

    def finish_wandb(self, summary: dict[str, Any]) -> None:
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if v is not None})
            self.wandb.finish()
            self.wandb = None


def base_summary(run: RunConfig, out: Path) -> dict[str, Any]:
    """A trial's summary.json as it starts: every field the tables read, filled in at the end."""
    return {
        "trial": out.name,
        "status": "running",
        "method": run.label or run.method_name,
        "method_name": run.method_name,
        "params": run.method_params,
        "lr": run.train.lr,
        "seed": run.seed,
        "model": run.model,
        "steps": run.train.steps,
        "step": 0,
        "tokens": 0,
        "eval_loss": None,
        "eval_ppl": None,
        "tokens_per_s": None,
        "mfu": None,
        "peak_memory_bytes": None,
        "param_bytes": None,
        "grad_bytes": None,
        "optimizer_state_bytes": None,
        "trainable_params": None,
        "wall_s": None,
        "device": None,
        "error": None,
        "requeues": 0,
        "host": socket.gethostname(),
        "started_at": time.time(),
    }
