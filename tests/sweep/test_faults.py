"""Faults a sweep meets without a cluster: a trial stopped by a signal is resubmitted, a sweep
left unfinished says so, a SIGKILLed trial is `killed`, repeated preemption signals to a
submitit job make one requeue, and a trial's threads follow its allocation."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from conftest import STEPS_LEFT, harness_here, micro_run, start_sweep, wait_for_step, write_yaml

from harness.config import LauncherConfig
from harness.sweep.launchers import TrialJob, submit
from harness.trials import read_json


def sweep_file(tmp_path: Path, steps: int, lrs: list[float]) -> Path:
    run = micro_run(steps=steps, log_every=1)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 64}
    data.update(name="faults", methods={"full": {}}, search={"space": {"train.lr": lrs}})
    return write_yaml(tmp_path / "faults.yaml", data)


def running_trial(out: Path, timeout_s: float = 120) -> Path:
    """The first trial whose process has written its pid."""
    deadline = time.time() + timeout_s
    while True:
        for summary in sorted(out.glob("trials/*/summary.json")):
            if (read_json(summary) or {}).get("pid"):
                return summary.parent
        assert time.time() < deadline, "no trial started"
        time.sleep(0.2)


def stop_at_step(out: Path, step: int, sig: int) -> Path:
    trial_dir = running_trial(out)
    wait_for_step(trial_dir, step)
    os.kill(read_json(trial_dir / "summary.json")["pid"], sig)
    return trial_dir


def test_an_interrupted_trial_is_resubmitted_before_the_sweep_ends(tmp_path):
    """USR2 straight to a local trial (as a cluster's preemption would): it stops with a
    checkpoint; the sweep runs it again from there and ends 0, the requeue counted."""
    out, steps = tmp_path / "runs", 3 + STEPS_LEFT
    proc = start_sweep(sweep_file(tmp_path, steps, [3e-3]), out)
    trial_dir = stop_at_step(out, 3, signal.SIGUSR2)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    assert "1 trials interrupted with a checkpoint: resubmitting them (1 of at most 3)" in stdout
    summary = read_json(trial_dir / "summary.json")
    assert (summary["status"], summary["requeues"], summary["step"]) == ("ok", 1, steps)
    assert "resumed from" in stdout
    # One local trial at a time gets every CPU this process may use.
    assert summary["threads"] == len(os.sched_getaffinity(0))


def test_a_sweep_left_unfinished_exits_3_and_names_the_trial_and_its_resume(tmp_path):
    out, path = tmp_path / "runs", sweep_file(tmp_path, 2 + STEPS_LEFT, [3e-3])
    proc = start_sweep(path, out, "launcher.max_requeues=0")
    trial_dir = stop_at_step(out, 2, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 3, stdout + stderr
    step = read_json(trial_dir / "summary.json")["step"]
    assert stderr.splitlines()[-1] == (
        f"unfinished: {trial_dir.name} (interrupted at step {step}); resume: harness sweep "
        f"{path} --out {out} --set launcher.max_requeues=0")

    again = harness_here("sweep", str(path), "--out", str(out))  # the command it names
    assert again.returncode == 0, again.stdout + again.stderr  # finishes the trial
    assert read_json(trial_dir / "summary.json")["status"] == "ok"


def test_a_sigkilled_trial_is_killed_and_the_sweep_carries_on(tmp_path):
    """What the kernel's OOM killer does: SIGKILL, no chance to write a word. The sweep
    records `killed` with the reason, runs the other trial, and exits 1."""
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 1 + STEPS_LEFT, [1e-3, 3e-3]), out, "launcher.jobs=2")
    killed = stop_at_step(out, 1, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stdout + stderr
    summary = read_json(killed / "summary.json")
    assert summary["status"] == "killed"
    assert summary["error"] == "trial process killed by signal 9 (SIGKILL)"
    others = [read_json(p) for p in out.glob("trials/*/summary.json") if p.parent != killed]
    assert [s["status"] for s in others] == ["ok"]


@pytest.mark.parametrize("gap_s", [0.2, 0.0])
def test_repeated_preemption_signals_to_a_submitit_job_make_one_requeue(tmp_path, gap_s):
    """Two USR2 to the job's task process, 0.2 s apart (the second while the first's
    checkpoint is written) or at once: one requeue, and the trial ends ok."""
    trial_dir, steps = tmp_path / "trial", 3 + STEPS_LEFT
    write_yaml(trial_dir / "config.yaml", micro_run(steps=steps, log_every=1))
    (job,) = submit(LauncherConfig(kind="submitit-local", timeout_min=10), tmp_path / "jobs",
                    [TrialJob(trial_dir)])
    wait_for_step(trial_dir, 3)
    task = psutil.Process(read_json(trial_dir / "summary.json")["pid"]).parent()
    task.send_signal(signal.SIGUSR2)
    time.sleep(gap_s)
    task.send_signal(signal.SIGUSR2)
    assert job.result() == 0
    summary = read_json(trial_dir / "summary.json")
    assert (summary["status"], summary["requeues"], summary["step"]) == ("ok", 1, steps)
    ignored = Path(job.paths.stdout).read_text().count(
        "signal SIGUSR2 ignored: a requeue is under way")
    # Two USR2 sent at once may reach the process as one: POSIX does not queue standard signals.
    assert ignored == 1 if gap_s else ignored <= 1
