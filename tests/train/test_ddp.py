"""Data parallelism: 2 processes (gloo, CPU) train exactly as 1 process with the same global batch.

The 2 ranks are forked warm with torchrun's environment (tests/ranks.py); the interrupted
pair is the real command under torchrun, as a user starts it, whose agent stops the other rank
once one ends. The 1-process reference runs in this process. All use one thread, so kernels
sum in the same order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import free_port, micro_run, ranks, torchrun, write_yaml
from ranks import Ranks

from harness.cli import main
from harness.cost.estimate import estimate_run
from harness.methods.resolve import load_run
from harness.train import train
from harness.trials import read_json, read_jsonl

GALORE = {"name": "galore", "rank": 8, "update_proj_gap": 3}


def ddp_run(steps: int = 6, method: dict[str, Any] | None = None,
            layerwise: bool = False) -> dict[str, Any]:
    """4 micro-batches of 2 per step: 2 per process, so accumulation runs under DDP too."""
    data = micro_run(steps=steps, total_batch_size=8, keep_final="full")  # checkpoints read
    return {**data, "method": method or {"name": "full"}, "memory": {"layerwise": layerwise}}


def finish(proc: subprocess.Popen | Ranks) -> str:
    output, _ = proc.communicate(timeout=300)
    return output


def rows(out: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == kind]


def assert_same_losses(one: Path, two: Path) -> float:
    """Per-step and eval losses agree to 1e-5 relative; returns the largest difference."""
    a, b = rows(one, "train"), rows(two, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # global tokens
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5, abs=0)
    ea, eb = rows(one, "eval"), rows(two, "eval")
    assert [r["eval_tokens"] for r in ea] == [r["eval_tokens"] for r in eb]
    assert [r["eval_loss"] for r in eb] == pytest.approx([r["eval_loss"] for r in ea], rel=1e-5)
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))


def test_two_processes_train_as_one(tmp_path):
    """Through `harness train` and torchrun's environment; every method, both precisions, with
    and without accumulation: tests/train/test_equality.py."""
    method = {"name": "full"}
    data = ddp_run(method=method)
    proc = ranks(write_yaml(tmp_path / "run.yaml", data), tmp_path / "two")
    one = train(load_run(data), tmp_path / "one")  # runs while the children start up
    output = finish(proc)
    assert proc.returncode == 0, output
    two = read_json(tmp_path / "two" / "summary.json")
    assert one["status"] == two["status"] == "ok"
    diff = assert_same_losses(tmp_path / "one", tmp_path / "two")
    print(f"{method['name']}: max |loss 1 proc - loss 2 proc| = {diff:.2e}")
    # rank 0 alone wrote the folder, and its checkpoint is a 1-process one
    names = {p.name for p in (tmp_path / "two").iterdir()}
    assert names == {"config.yaml", "metrics.jsonl", "summary.json", "checkpoint", "model",
                     "model.json"}
    model = torch.load(tmp_path / "two" / "checkpoint" / "state.pt", weights_only=False)["model"]
    reference = torch.load(tmp_path / "one" / "checkpoint" / "state.pt", weights_only=False)
    assert model.keys() == reference["model"].keys()
    assert output.count("step 6/6") == 1  # progress lines come from rank 0 only


@pytest.mark.parametrize(("method", "layerwise"),
                         [(GALORE, True), ({"name": "qgalore", "rank": 8}, False)],
                         ids=["galore_layerwise", "qgalore"])
def test_the_estimate_for_two_processes_is_what_each_of_two_processes_holds(
    tmp_path, method, layerwise
):
    """4 sequences of 2 per step over 2 processes: one micro-batch each, so the layer-wise
    update frees every gradient in its own backward. The estimate for the launcher's 2
    processes counts that (the largest gradient); one process would accumulate two (all)."""
    data = {**micro_run(steps=1, total_batch_size=4), "method": method,
            "memory": {"layerwise": layerwise}}
    proc = ranks(write_yaml(tmp_path / "run.yaml", data), tmp_path / "two")
    output = finish(proc)
    assert proc.returncode == 0, output
    two = read_json(tmp_path / "two" / "summary.json")
    run = load_run(data)
    estimate = estimate_run(run, world=2)
    assert two["grad_bytes"] == estimate["grad_bytes"] < estimate_run(run)["grad_bytes"]
    assert two["param_bytes"] == estimate["weight_bytes"]
    assert two["optimizer_state_bytes"] == estimate["optimizer_state_bytes"]
    assert two["extra_bytes"] == estimate["extra_bytes"]


def test_interrupted_two_processes_resume_where_they_stopped(tmp_path):
    """SIGINT reaches rank 1 only: both ranks agree to stop at the same step, and the resumed
    pair's losses are the uninterrupted ones."""
    data = {**ddp_run(steps=10), "eval": {"every": 5, "tokens": 256}}
    config = write_yaml(tmp_path / "run.yaml", data)
    proc = torchrun(config, tmp_path / "two")
    for line in proc.stdout:  # rank 0's progress: wait until both ranks are training
        if line.startswith("step 2/"):
            break
    workers = psutil.Process(proc.pid).children()
    rank1 = next(w for w in workers if w.environ().get("RANK") == "1")
    os.kill(rank1.pid, signal.SIGINT)
    finish(proc)
    stopped = read_json(tmp_path / "two" / "summary.json")
    assert stopped["status"] == "interrupted" and 2 <= stopped["step"] < 10, stopped
    print(f"SIGINT to rank 1 after step 2: both stopped at step {stopped['step']}")
    proc = torchrun(config, tmp_path / "two")
    one = train(load_run(data), tmp_path / "one")
    output = finish(proc)
    assert proc.returncode == 0, output
    assert f"resumed from {tmp_path / 'two' / 'checkpoint' / 'state.pt'}" in output
    assert read_json(tmp_path / "two" / "summary.json")["step"] == one["step"] == 10
    assert [r["step"] for r in rows(tmp_path / "two", "train")] == list(range(1, 11))
    assert_same_losses(tmp_path / "one", tmp_path / "two")


def test_a_global_batch_that_does_not_split_over_the_processes_is_one_line(
    tmp_path, monkeypatch, capsys
):
    """The environment a launcher gives rank 0 of 3; refused before joining any group."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = write_yaml(tmp_path / "run.yaml", ddp_run(steps=1))  # 8 sequences, batch_size 2
    started = time.time()
    assert main(["train", str(config), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "train.total_batch_size" in err and "use a multiple of 6" in err
    assert time.time() - started < 30  # no rendezvous waited for
