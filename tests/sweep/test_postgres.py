"""Optuna study storage on a real PostgreSQL server (`bash scripts/postgres.sh start`; CI starts
it): several sweep workers share one study, and a dead worker's trial is retried by another."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from conftest import REPO, micro_run, require_service, wait_for_step, write_yaml
from optuna.trial import TrialState

from harness.sweep.study import open_storage
from harness.trials import read_json, read_jsonl


@pytest.fixture
def url() -> str:
    return require_service(
        "HARNESS_PG_URL", "a PostgreSQL server", "bash scripts/postgres.sh start"
    )


def sweep_file(tmp_path: Path, url: str, n_trials: int, steps: int) -> tuple[Path, str]:
    """A fresh study name per test: the database outlives the tests."""
    name = f"pg-{uuid.uuid4().hex[:8]}"
    run = micro_run(steps=steps, log_every=1, checkpoint_every=5)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 128}
    data.update(
        name=name, storage=url, methods={"full": {}},
        search={"sampler": "random", "n_trials": n_trials, "heartbeat_s": 1,
                "space": {"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}},
    )
    return write_yaml(tmp_path / f"{name}.yaml", data), f"{name}/full"


def worker(path: Path, out: Path) -> subprocess.Popen:
    """One `harness sweep` process: on a cluster, one per node, all on the same storage."""
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "sweep", str(path), "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return out


def test_two_workers_share_one_study_without_duplicates(tmp_path, url):
    path, study_name = sweep_file(tmp_path, url, n_trials=4, steps=8)
    out = tmp_path / "runs"
    logs = [finished(p) for p in [worker(path, out), worker(path, out)]]
    trials = optuna.load_study(study_name=study_name, storage=open_storage(url)).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    ids = [t.user_attrs["trial_id"] for t in trials]
    assert len(set(ids)) == 4 and set(ids) == {d.name for d in (out / "trials").iterdir()}
    for trial_id in ids:  # each trial trained once: one line per step, never resumed
        steps = [r["step"] for r in read_jsonl(out / "trials" / trial_id / "metrics.jsonl")
                 if r["kind"] == "train"]
        assert steps == list(range(1, 9))
    assert all("4 trials" in log or "of 4 trials finished" in log for log in logs)


def test_a_killed_workers_trial_is_retried_by_the_other(tmp_path, url):
    path, study_name = sweep_file(tmp_path, url, n_trials=2, steps=40)
    out = tmp_path / "runs"
    first = worker(path, out)
    deadline = time.time() + 120
    while not (out / "trials").is_dir() or not any((out / "trials").iterdir()):
        assert time.time() < deadline
        time.sleep(0.2)
    (killed_dir,) = (out / "trials").iterdir()
    wait_for_step(killed_dir, 12)
    second = worker(path, out)
    os.killpg(first.pid, signal.SIGKILL)  # the worker and its trial die mid-trial
    first.communicate()
    log = finished(second)

    trials = optuna.load_study(study_name=study_name, storage=open_storage(url)).get_trials()
    states = [t.state for t in trials]
    assert states.count(TrialState.FAIL) == 1 and states.count(TrialState.COMPLETE) == 2
    failed = next(t for t in trials if t.state == TrialState.FAIL)
    retry = next(t for t in trials if t.system_attrs.get("failed_trial") == failed.number)
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["trial_id"] == failed.user_attrs["trial_id"] == killed_dir.name
    assert read_json(killed_dir / "summary.json")["status"] == "ok"
    resumed = re.search(rf"resumed from {killed_dir}/checkpoint/state.pt at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 10, log[-3000:]  # from the dead worker's ckpt
