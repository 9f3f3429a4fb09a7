"""Shared fixtures: a micro LLaMA on the embedded sample corpus, small enough for CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# No test may reach for the hub: fail fast instead of waiting on retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_SILENT"] = "true"

REPO = Path(__file__).resolve().parents[1]


def micro_run(**train: Any) -> dict[str, Any]:
    """A run config that trains in about a second a step on 2 CPU cores."""
    return {
        "name": "test",
        "model": "llama_micro",
        "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32, "shuffle_buffer": 32},
        "train": {
            "lr": 0.003,
            "steps": 6,
            "batch_size": 2,
            "total_batch_size": 4,
            "warmup_steps": 1,
            "log_every": 1,
            **train,
        },
        "eval": {"every": 3, "tokens": 256},
        "method": {"name": "full"},
    }


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def harness(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real command line, in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ},
        timeout=600,
    )


@pytest.fixture
def micro() -> dict[str, Any]:
    return micro_run()


@pytest.fixture(autouse=True)
def one_thread():
    """OpenMP threads spin-wait when 2 cores are oversubscribed (a CI box running other work),
    which turns a 1 s SVD into a minute; one thread keeps test times steady."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_estimate_matches(estimate: Any, summary: dict[str, Any]) -> None:
    """The analytic prediction equals the bytes counted from the trained model's tensors."""
    assert estimate.weight_bytes == summary["param_bytes"]
    assert estimate.grad_bytes == summary["grad_bytes"]
    assert estimate.optimizer_state_bytes == summary["optimizer_state_bytes"]
    assert estimate.extra_bytes == summary["extra_bytes"]


def require_service(env: str, what: str, start: str) -> str:
    """Tests on a real cluster or database: skipped (with the reason) on a developer's machine
    where it is not running, but never in CI, where `.ci/run` starts it."""
    value = os.environ.get(env)
    if value:
        return value
    if os.environ.get("CI"):
        pytest.fail(f"{what} is required in CI but {env} is unset (.ci/run starts it)")
    pytest.skip(f"needs {what}: `{start}`, then set {env}")


def train_losses(trial_dir: Path) -> dict[int, float]:
    """Logged training loss by step, for comparing an interrupted run with a clean one."""
    from harness.trials import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(trial_dir / "metrics.jsonl")
            if r["kind"] == "train"}


def wait_for_step(trial_dir: Path, step: int, timeout_s: float = 300) -> None:
    import time

    deadline = time.time() + timeout_s
    while max(train_losses(trial_dir), default=0) < step:
        assert time.time() < deadline, f"{trial_dir} never reached step {step}"
        time.sleep(0.2)


def assert_matches_one_process(trial_dir: Path, run: dict[str, Any], scratch: Path) -> None:
    """A data-parallel trial's losses equal those of `run` trained here in one process."""
    from harness.methods.resolve import load_run
    from harness.train import train
    from harness.trials import read_json

    single = train(load_run(run), scratch)
    ddp, one = train_losses(trial_dir), train_losses(scratch)
    assert ddp.keys() == one.keys()
    assert all(abs(ddp[s] - one[s]) < 1e-5 for s in one)
    assert read_json(trial_dir / "summary.json")["eval_loss"] == pytest.approx(
        single["eval_loss"], rel=1e-5)
