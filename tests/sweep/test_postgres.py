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
from typing import IO

import optuna
import pytest
from conftest import REPO, micro_run, train_losses, write_yaml
from optuna.trial import TrialState
from services import require_service

from harness.sweep.search.study import open_storage
from harness.trials import read_json, read_jsonl


@pytest.fixture
def url() -> str:
    return require_service(
        "HARNESS_PG_URL", "a PostgreSQL server", "bash scripts/postgres.sh start"
    )


def sweep_file(tmp_path: Path, url: str, n_trials: int, steps: int,
               checkpoint_every: int = 5) -> tuple[Path, str]:
    """A fresh study name per test: the database outlives the tests."""
    name = f"pg-{uuid.uuid4().hex[:8]}"
    run = micro_run(steps=steps, log_every=1, checkpoint_every=checkpoint_every)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 128}
    data.update(
        name=name, storage=url, methods={"full": {}},
        search={"sampler": "random", "n_trials": n_trials, "heartbeat_s": 1,
                "space": {"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}},
    )
    return write_yaml(tmp_path / f"{name}.yaml", data), f"{name}/full"


def worker(path: Path, out: Path, log: IO[str] | None = None) -> subprocess.Popen:
    """One `harness sweep` process: on a cluster, one per node, all on the same storage. Its
    output goes to `log` if given (many workers at once would fill their pipes)."""
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "sweep", str(path), "--out", str(out)],
        cwd=REPO, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return out


# Two workers of 4 trials: the eight workers' test below asks the same of 8 workers and 48
# trials (each trial once in the study and the folder, every step logged once, each worker's
# count of the study's trials), and more
EXHAUSTIVE = {"test_two_workers_share_one_study_without_duplicates": {()}}


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


# A worker loop of the sweep's own (StudySource and Worker) whose trial only writes its summary:
# asks and tells as fast as they come, so that the workers of many processes contend.
FAST_WORKER = """
import sys, time
from pathlib import Path
from harness.sweep.plan.expand import load_sweep
from harness.sweep.search.study_source import StudySource
from harness.sweep.run.worker import Worker
from harness.trials import TrialDir

def run_trial(trial_id, trial_dir):
    time.sleep(0.05)
    TrialDir(trial_dir).write_summary({"trial": trial_id, "status": "ok", "eval_ppl": 1.0})
    return 0

path, out, go = map(Path, sys.argv[1:])
source = StudySource(load_sweep(path, {}), out, 0)
(out / f"ready-{source.name.replace('/', '-')}").touch()
while not go.exists():
    time.sleep(0.01)
Worker(source, run_trial).run()
"""


def test_workers_of_many_processes_never_ask_past_the_budget(tmp_path, url):
    """8 processes asking at once: the budget check and the ask are one step across them, so
    the study ends with exactly n_trials trials, each asked once."""
    path, study_name = sweep_file(tmp_path, url, TRIALS, STEPS)
    out, go = tmp_path / "runs", tmp_path / "go"
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", FAST_WORKER, str(path), str(out), str(go)],
                              cwd=REPO) for _ in range(WORKERS)]
    deadline = time.time() + 300
    while len(list(out.glob("ready-*"))) < WORKERS:
        assert time.time() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)
    go.touch()
    assert [p.wait(timeout=300) for p in procs] == [0] * WORKERS
    trials = optuna.load_study(study_name=study_name, storage=open_storage(url)).get_trials()
    assert len(trials) == TRIALS, f"{len(trials)} trials asked, the budget is {TRIALS}"
    assert [t.number for t in trials] == list(range(TRIALS))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({t.user_attrs["trial_id"] for t in trials}) == TRIALS


WORKERS, TRIALS, STEPS = 8, 48, 10


def ancestors(pid: int) -> list[int]:
    """The process's parent, its parent's parent, ... (/proc/PID/stat: "pid (comm) state
    ppid ..."); none where it has ended."""
    chain = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])
        except FileNotFoundError:
            return []
        chain.append(pid)
    return chain


def kill_a_worker_mid_trial(workers: list[subprocess.Popen], out: Path) -> tuple[str, int]:
    """SIGKILL the first worker (and its trial process: its process group, as a node lost
    takes both) whose trial is past its checkpoint at step 2 and far from its end; the
    trial's id and the last step it had logged."""
    by_pid = {p.pid: p for p in workers}
    deadline = time.time() + 300
    while time.time() < deadline:
        for trial in (out / "trials").glob("*"):
            summary = read_json(trial / "summary.json") or {}
            step = max(train_losses(trial), default=0)
            if summary.get("status") != "running" or not 3 <= step <= STEPS - 4:
                continue
            worker = next((pid for pid in ancestors(summary["pid"]) if pid in by_pid), None)
            if worker is not None:  # its trials are forked by its fork server, in its group
                os.killpg(worker, signal.SIGKILL)
                by_pid[worker].wait()
                return trial.name, step
        time.sleep(0.05)
    raise AssertionError("no trial reached step 3 of a live worker")


def test_eight_workers_run_48_trials_once_though_one_is_killed(tmp_path, url):
    """8 `harness sweep` processes on one study, 48 trials; one worker is killed mid-trial.
    Every trial is recorded once, in the study and in the run folder, none is lost or run
    twice, and the killed one is retried by heartbeat by another worker (the same point and
    trial id) and resumes from the newest checkpoint the dead worker's trial wrote."""
    path, study_name = sweep_file(tmp_path, url, TRIALS, STEPS, checkpoint_every=2)
    out, logs = tmp_path / "runs", [tmp_path / f"worker{i}.log" for i in range(WORKERS)]
    workers = []
    for log in logs:
        with log.open("w") as f:
            workers.append(worker(path, out, f))
    killed, seen = kill_a_worker_mid_trial(workers, out)
    for p, log in zip(workers, logs, strict=True):
        p.wait(timeout=900)
        assert p.returncode in (0, -signal.SIGKILL), log.read_text()[-3000:]
    assert sorted(p.returncode for p in workers) == [-signal.SIGKILL] + [0] * (WORKERS - 1)
    text = "".join(log.read_text() for log in logs)
    assert all(f"of {TRIALS} trials finished" in log.read_text() for log in logs)  # at start

    # The study: 48 COMPLETE trials with distinct points, plus the killed one, FAIL, whose
    # retry (same point, same trial id) is one of the 48.
    trials = optuna.load_study(study_name=study_name, storage=open_storage(url)).get_trials()
    assert [t.number for t in trials] == list(range(TRIALS + 1))
    states = [t.state for t in trials]
    assert states.count(TrialState.COMPLETE) == TRIALS and states.count(TrialState.FAIL) == 1
    (failed,) = [t for t in trials if t.state == TrialState.FAIL]
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == failed.number]
    assert retry.state == TrialState.COMPLETE and retry.params == failed.params
    assert retry.user_attrs["trial_id"] == failed.user_attrs["trial_id"] == killed
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    ids = [t.user_attrs["trial_id"] for t in complete]
    assert len(set(ids)) == TRIALS and len({t.params["train.lr"] for t in complete}) == TRIALS

    # The run folder: one folder per trial, each finished once with the value the study holds.
    assert {d.name for d in (out / "trials").iterdir()} == set(ids)
    for t in complete:
        trial_id = t.user_attrs["trial_id"]
        summary = read_json(out / "trials" / trial_id / "summary.json")
        assert summary["status"] == "ok" and summary["trial"] == trial_id
        assert t.value == summary["eval_ppl"]
        assert sorted(train_losses(out / "trials" / trial_id)) == list(range(1, STEPS + 1))
        # Started once and ended once: a trial run twice would log its first or last step
        # twice; only the killed one resumed, from its checkpoint (step 2 or later).
        assert text.count(f"[{trial_id}] step 1/{STEPS} ") == 1, trial_id
        assert text.count(f"[{trial_id}] step {STEPS}/{STEPS} ") == 1, trial_id
    (resumed,) = re.findall(r"\[(\S+)\] resumed from \S+ at step (\d+)", text)
    # step `seen` logged: the checkpoint of the even step before it was whole (saved between)
    assert resumed[0] == killed and int(resumed[1]) >= 2 * ((seen - 1) // 2), (resumed, seen)
