"""What a training run keeps in its trial folder: config with provenance, metrics, summary,
checkpoint (with the RNG states it resumes) and its wandb run."""

from __future__ import annotations

import json
import platform
import random
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.config import RunConfig
from harness.errors import UserError
from harness.trials import checkpoints, sharded
from harness.trials.files import append_jsonl, atomic_write, read_jsonl
from harness.trials.folder import TrialDir
from harness.trials.status import Status
from harness.trials.summary import Summary

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
    """The trainer's writer of one trial folder (`TrialDir`): config, metrics, summary,
    checkpoint. Under DDP only rank 0's writes happen (distributed.main_only)."""

    def __init__(self, out: Path, run: RunConfig) -> None:
        self.out = Path(out)
        self.dir = TrialDir(self.out)
        self.run = run
        self.metrics_path = self.dir.metrics
        self.summary_path = self.dir.summary
        self.ckpt_dir = self.dir.checkpoints
        self.loaded: Path | None = None  # the checkpoint the run resumed from
        self.skipped: list[tuple[Path, str]] = []  # newer ones that did not load, and why
        self.unreadable: str | None = None  # an earlier summary that could not be read: why
        self.wandb: Any = None

    def write_config(self) -> None:
        self.dir.write_config(self.run, provenance())

    def summary(self) -> Summary | None:
        """The summary an earlier run left; None if there is none or it cannot be read (then
        the first `write_summary` moves that file aside and says so)."""
        summary = self.dir.read_summary()
        if summary is not None and summary.status == Status.UNREADABLE:
            self.unreadable = summary.error
            return None
        return summary

    def write_summary(self, summary: Summary | dict[str, Any]) -> None:
        if self.unreadable is not None and self.dir.summary.exists():
            moved = self.dir.set_aside_summary()
            print(f"warning: {self.unreadable}; moved to {moved.name}, this run writes a new "
                  "summary", file=sys.stderr, flush=True)
        self.unreadable = None
        self.dir.write_summary(summary)

    def log(self, row: dict[str, Any]) -> None:
        append_jsonl(self.metrics_path, row)
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in row.items() if k not in ("kind", "step")}, step=row["step"]
            )

    def truncate_metrics(self, step: int) -> None:
        """On resume, drop what was logged after the checkpoint: it will be logged again."""
        rows = [r for r in read_jsonl(self.metrics_path) if r.get("step", 0) <= step]
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Atomic, fsynced and checksummed; the `train.keep_checkpoints` newest kept. A failed
        save (a full disk) raises CheckpointError and leaves the previous ones whole."""
        checkpoints.save(self.ckpt_dir, {**state, "identity": self.run.identity()},
                         self.run.train.keep_checkpoints)

    def save_sharded_checkpoint(self, parts: dict[str, dict[str, Any]], rest: dict[str, Any],
                                background: sharded.Background | None = None) -> None:
        """A sharded trial's checkpoint, which every rank writes its part of (a collective, so
        `main_only` lets it through on every rank): see `checkpoints.save_sharded`."""
        checkpoints.save_sharded(self.ckpt_dir, parts, {**rest, "identity": self.run.identity()},
                                 self.run.train.keep_checkpoints, background)

    def load_checkpoint(self, read: checkpoints.Read | None = None) -> dict[str, Any] | None:
        """The newest checkpoint that loads (None: none written yet), `read` taking a sharded
        one's tensors once its config is known to be this one's; CheckpointError when none
        does, UserError when it is another config's."""

        def checked(path: Path, state: dict[str, Any]) -> None:
            if state.get("identity") != self.run.identity():
                raise UserError(
                    f"{path}: written by a different config ({state.get('identity')}, this "
                    f"run is {self.run.identity()}); use another --out or delete that folder")
            if read is not None and "sharded" in state:
                read(path, state)

        found = checkpoints.load_newest(self.ckpt_dir, checked)
        if found is None:
            return None
        self.loaded, self.skipped = found.path, found.skipped
        return found.state

    def set_aside_skipped(self) -> None:
        """One line on stderr for each checkpoint the resume skipped, moved out of the rotation
        so that later saves do not keep it in place of a good one."""
        for path, reason in self.skipped:
            moved = checkpoints.set_aside(path)
            print(f"warning: checkpoint {path} does not load ({reason}); moved to {moved.name}, "
                  f"resuming from {self.loaded}", file=sys.stderr, flush=True)
        self.skipped = []

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
