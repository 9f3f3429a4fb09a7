"""Launchers without a cluster: profiles, crashes, refilled slots, submitit-local preemption."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from conftest import (
    STEPS_LEFT,
    assert_matches_one_process,
    harness_here,
    micro_run,
    wait_for_step,
    write_yaml,
)
from conftest import train_losses as losses

from harness.config import LauncherConfig
from harness.config.launchers.slurm import SlurmConfig
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.sweep.launchers.local import LocalLauncher
from harness.sweep.launchers.slurm import submit
from harness.sweep.launchers.slurm_job import TrialJob
from harness.sweep.plan.expand import load_sweep
from harness.sweep.search.study import open_storage
from harness.train import train
from harness.trials import RunsDir, read_json


def sweep_file(tmp_path: Path, **extra) -> Path:
    run = micro_run(steps=4)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 64}
    data.update(name="grid", methods={"full": {}}, search={"space": {"train.lr": [1e-3, 3e-3]}})
    data.update(extra)
    return write_yaml(tmp_path / "sweeps" / "grid.yaml", data)


def test_profile_fills_launcher_keys_and_the_sweep_overrides_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_yaml(tmp_path / "slurm" / "big.yaml",
               {"kind": "slurm", "partition": "gpu", "jobs": 8, "setup": ["module load cuda"]})
    path = sweep_file(tmp_path, launcher={"profile": "big", "jobs": 2})
    launcher = load_sweep(path, {}).launcher
    assert (launcher.kind, launcher.partition, launcher.jobs) == ("slurm", "gpu", 2)
    assert launcher.setup == ["module load cuda"]

    write_yaml(tmp_path / "slurm" / "typo.yaml", {"partiton": "gpu"})
    with pytest.raises(UserError, match="did you mean 'partition'") as e:
        load_sweep(path, {"launcher.profile": "typo"})
    assert "typo.yaml" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"unknown cluster profile 'bog'.*did you mean 'big'"):
        load_sweep(path, {"launcher.profile": "bog"})


def test_launcher_keys_are_checked(tmp_path):
    path = sweep_file(tmp_path)
    with pytest.raises(UserError, match=r"unknown key 'launcher.partiton'.*'partition'"):
        load_sweep(path, {"launcher.partiton": "gpu"})
    with pytest.raises(UserError, match="needs kind submitit-local or slurm"):
        load_sweep(path, {"launcher.tasks_per_node": 2})


def test_a_killed_trial_is_recorded_killed_and_the_slot_moves_on(tmp_path):
    trial_dir = tmp_path / "trial"
    write_yaml(trial_dir / "config.yaml", micro_run(steps=500, checkpoint_every=0))
    launcher = LocalLauncher(LauncherConfig(jobs=1), tmp_path)
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(launcher.run_one("t", trial_dir)))
    worker.start()
    wait_for_step(trial_dir, 1)
    os.kill(read_json(trial_dir / "summary.json")["pid"], signal.SIGKILL)
    worker.join(timeout=60)
    assert codes == [-signal.SIGKILL]
    summary = read_json(trial_dir / "summary.json")
    assert summary["status"] == "killed"
    assert summary["error"] == "trial process killed by signal 9 (SIGKILL)"


def test_local_slots_refill_as_trials_end(tmp_path):
    launcher = LocalLauncher(LauncherConfig(jobs=2), tmp_path)
    starts: dict[int, float] = {}

    def task(i: int, seconds: float) -> int:
        starts[i] = time.time()
        time.sleep(seconds)
        return i

    t0 = time.time()
    assert launcher.pool([lambda: task(0, 1.5), lambda: task(1, 0.2), lambda: task(2, 0.2)]) == [
        0, 1, 2]
    assert starts[2] - t0 < 1.0  # it took the slot task 1 freed, not waiting for task 0


# A submitit-local job preempted: its requeue and ok end are tests/sweep/test_faults.py's
# repeated-preemption test's (the same submit, USR2 to the same task process); a preempted
# submitit job's losses and eval loss equal to a run never stopped, tests/sweep/test_slurm.py's
# under real Slurm (the same TrialJob resuming the same checkpoint)
EXHAUSTIVE = {"test_submitit_local_trial_preempted_resumes_with_the_same_losses": {()}}


def test_submitit_local_trial_preempted_resumes_with_the_same_losses(tmp_path, monkeypatch):
    # The job's trial inherits one thread, as the in-process reference runs (conftest): with a
    # different thread count, some CPUs' matmul kernels split sums differently.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = micro_run(steps=3 + STEPS_LEFT, log_every=1)
    run["eval"] = {"every": 0, "tokens": 128}
    reference = train(load_run(run), tmp_path / "reference")

    trial_dir = tmp_path / "preempted"
    write_yaml(trial_dir / "config.yaml", run)
    launcher = SlurmConfig(kind="submitit-local", timeout_min=10)
    (job,) = submit(launcher, tmp_path / "jobs", [TrialJob(trial_dir)])
    wait_for_step(trial_dir, 3)
    # What Slurm does on preemption: USR2 to the job step, here the submitit task process
    # (submitit-local's own `_interrupt` signals its controller, which does not forward USR2).
    task = psutil.Process(read_json(trial_dir / "summary.json")["pid"]).parent()
    task.send_signal(signal.SIGUSR2)
    assert job.result() == 0
    summary = read_json(trial_dir / "summary.json")
    assert summary["status"] == "ok" and summary["requeues"] == 1
    assert "resumed from" in Path(job.paths.stdout).read_text()
    assert losses(trial_dir) == losses(tmp_path / "reference")
    assert summary["eval_loss"] == reference["eval_loss"]


def test_grid_sweep_on_submitit_local_and_status_columns(tmp_path):
    path = sweep_file(tmp_path)
    out = tmp_path / "runs"
    done = harness_here("sweep", str(path), "--out", str(out), "--set",
                        "launcher.kind=submitit-local", "--jobs", "2")
    assert done.returncode == 0, done.stderr
    trials = sorted((out / "trials").iterdir())
    assert len(trials) == 2
    for trial_dir in trials:
        assert read_json(trial_dir / "summary.json")["status"] == "ok"
        assert read_json(trial_dir / "launch.json")["launcher"] == "submitit-local"
    status = harness_here("status", str(out))
    header = status.stdout.splitlines()[0].split()
    assert {"loss", "requeues"} <= set(header), status.stdout
    last = losses(trials[0])[4]
    assert f"{last:.4f}" in status.stdout


def test_a_ddp_trial_through_submitit_tasks_matches_one_process(tmp_path):
    """tasks_per_node=2: submitit starts two tasks, each sets torchrun's variables for its
    trial process; the trial equals a 1-process run with the same global batch."""
    path = sweep_file(tmp_path, search={"space": {"train.lr": [3e-3]}})
    out = tmp_path / "runs"
    done = harness_here("sweep", str(path), "--out", str(out), "--set",
                        "launcher.kind=submitit-local", "--set", "launcher.tasks_per_node=2")
    assert done.returncode == 0, done.stdout + done.stderr
    (trial_dir,) = (out / "trials").iterdir()
    run = micro_run(steps=4, lr=3e-3) | {"eval": {"every": 0, "tokens": 64}}
    assert_matches_one_process(trial_dir, run, tmp_path / "single")


def test_an_optuna_worker_of_two_tasks_runs_each_trial_on_both(tmp_path):
    """An Optuna search on tasks_per_node=2: one worker job asks for two trials in turn (rank
    0 asks, rank 1 follows what it posts); each trial is one 2-process trial equal to a
    1-process run, and the study records both."""
    space = {"train.lr": {"low": 1e-3, "high": 3e-3, "log": True}}
    path = sweep_file(tmp_path, search={"sampler": "random", "n_trials": 2, "space": space})
    out = tmp_path / "runs"
    done = harness_here("sweep", str(path), "--out", str(out), "--set",
                        "launcher.kind=submitit-local", "--set", "launcher.tasks_per_node=2")
    assert done.returncode == 0, done.stdout + done.stderr
    trial_dirs = sorted((out / "trials").iterdir())
    assert len(trial_dirs) == 2
    for k, trial_dir in enumerate(trial_dirs):
        run = yaml.safe_load((trial_dir / "config.yaml").read_text())
        assert_matches_one_process(trial_dir, run, tmp_path / f"single{k}")
    (job,) = (out / "jobs").glob("[0-9]*")  # both trials ran in the one worker job
    assert (job / f"{job.name}_1_log.err").read_text().count("rank 1/2: gloo") == 2
    storage = open_storage(str(RunsDir(out).journal))
    trials = optuna.load_study(study_name="grid/full", storage=storage).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
