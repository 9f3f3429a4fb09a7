"""Faults a sweep meets without a cluster: a trial stopped by a signal is resubmitted, a sweep
left unfinished says so, a SIGKILLed trial is `killed`, repeated preemption signals to a
submitit job make one requeue, a trial's threads follow its allocation, and every signal that
stops the sweep itself (TERM, HUP, USR2, even KILL) leaves its trials checkpointed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    REPO,
    STEPS_LEFT,
    harness_here,
    micro_run,
    start_sweep,
    wait_for_step,
    write_yaml,
)

from harness.config.launchers.slurm import SlurmConfig
from harness.sweep.launchers.slurm import submit
from harness.sweep.launchers.slurm_job import TrialJob
from harness.trials import checkpoints, read_json


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


# 0.2 s apart: tests/sweep/test_slurm.py's preempted trial gets the same pair through the same
# submitit task code under real Slurm (one requeue, the second ignored, the trial ends ok)
EXHAUSTIVE = {"test_repeated_preemption_signals_to_a_submitit_job_make_one_requeue": {(0.2,)}}


@pytest.mark.parametrize("gap_s", [0.2, 0.0])
def test_repeated_preemption_signals_to_a_submitit_job_make_one_requeue(tmp_path, gap_s):
    """Two USR2 to the job's task process, 0.2 s apart (the second while the first's
    checkpoint is written) or at once: one requeue, and the trial ends ok."""
    trial_dir, steps = tmp_path / "trial", 3 + STEPS_LEFT
    write_yaml(trial_dir / "config.yaml", micro_run(steps=steps, log_every=1))
    (job,) = submit(SlurmConfig(kind="submitit-local", timeout_min=10), tmp_path / "jobs",
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


def start_sweep_process(path: Path, out: Path, *args: str) -> subprocess.Popen:
    """`harness sweep` in a child with its own process group (as a terminal or `timeout`
    starts it) and the stop signals at their defaults, whatever this test run inherited."""
    def defaults() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)

    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "sweep", str(path), "--out", str(out), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=defaults)


def trials_at_step(out: Path, count: int, step: int) -> list[Path]:
    """The sweep's `count` trials, once each has logged `step`."""
    deadline = time.time() + 300
    while len(list(out.glob("trials/*/metrics.jsonl"))) < count:
        assert time.time() < deadline, "the trials never started"
        time.sleep(0.2)
    trials = sorted(p.parent for p in out.glob("trials/*/metrics.jsonl"))
    for trial_dir in trials:
        wait_for_step(trial_dir, step)
    return trials


@pytest.mark.parametrize("sig, to", [
    (signal.SIGTERM, ["sweep"]),  # `kill PID`
    (signal.SIGTERM, ["sweep", "group"]),  # `timeout`: the sweep, then its process group
    (signal.SIGHUP, ["group"]),  # a closed terminal: its foreground process group
    (signal.SIGUSR2, ["sweep"]),  # Slurm's warning before a sweep job's time limit
], ids=["kill", "timeout", "hangup", "usr2"])
def test_a_stop_signal_checkpoints_every_running_trial_and_a_rerun_resumes_them(
        tmp_path, sig, to):
    """Every signal that asks a sweep to stop does what Ctrl-C does: both running trials
    save a checkpoint and end `interrupted`, the sweep exits 130 naming its resume command,
    and that command resumes each trial where it stopped. (Before, the sweep died at once,
    exit 143, and its trials ended `failed: BrokenPipeError` without a checkpoint.) Each
    signal leaves the same folders, each checkpoint verified whole at the trial's step; the
    command resumes them once, after `kill` (resuming is the same whichever signal stopped)."""
    out, steps = tmp_path / "runs", 3 + STEPS_LEFT
    path = sweep_file(tmp_path, steps, [1e-3, 3e-3])
    proc = start_sweep_process(path, out, "--jobs", "2")
    trials = trials_at_step(out, 2, 3)
    for whom in to:
        if whom == "sweep":
            proc.send_signal(sig)
        else:
            os.killpg(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout + stderr
    stopped = {t.name: read_json(t / "summary.json") for t in trials}
    assert [s["status"] for s in stopped.values()] == ["interrupted"] * 2
    assert all(s["step"] >= 3 for s in stopped.values())
    assert all((t / "checkpoint" / "state.pt").is_file() for t in trials)
    assert not any("BrokenPipe" in (t / "stderr.log").read_text() for t in trials)
    (line,) = [x for x in stderr.splitlines() if x.startswith("interrupted by")]
    assert line.startswith(
        f"interrupted by {signal.Signals(sig).name}: 2 trials stopped with a checkpoint (")
    assert line.endswith(f"); resume: harness sweep {path} --out {out} --jobs 2")
    assert all(f"{name} at step {s['step']}" in line for name, s in stopped.items())
    for trial_dir in trials:  # written whole: its record's checksum, the step it stopped at
        loaded = checkpoints.load_newest(trial_dir / "checkpoint")
        assert loaded is not None and loaded.path.name == "state.pt" and not loaded.skipped
        assert loaded.state["step"] == stopped[trial_dir.name]["step"]
    if (sig, to) != (signal.SIGTERM, ["sweep"]):
        return

    again = harness_here("sweep", str(path), "--out", str(out), "--jobs", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    for trial_dir in trials:
        step = stopped[trial_dir.name]["step"]
        assert (f"[{trial_dir.name}] resumed from {trial_dir}/checkpoint/state.pt at step "
                f"{step}") in again.stdout
        summary = read_json(trial_dir / "summary.json")
        assert (summary["status"], summary["step"]) == ("ok", steps)


def test_a_sweep_killed_outright_leaves_its_trial_to_checkpoint_and_its_folder_free(tmp_path):
    """SIGKILL gives the sweep no say: its trial, left without a parent, stops with a
    checkpoint by itself (not `failed: BrokenPipeError` on its next line of output, nor
    training on unwatched), and the lock the sweep could not remove is taken over."""
    out, steps = tmp_path / "runs", 3 + STEPS_LEFT
    path = sweep_file(tmp_path, steps, [3e-3])
    proc = start_sweep_process(path, out)
    (trial_dir,) = trials_at_step(out, 1, 3)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 120
    while read_json(trial_dir / "summary.json")["status"] == "running":
        assert time.time() < deadline, "the orphaned trial never stopped"
        time.sleep(0.2)
    summary = read_json(trial_dir / "summary.json")
    assert summary["status"] == "interrupted" and summary["step"] < steps
    assert (trial_dir / "checkpoint" / "state.pt").is_file()

    again = harness_here("sweep", str(path), "--out", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith(
        f"{out}: taking over from a sweep that is gone (pid {proc.pid} on ")
    assert f"resumed from {trial_dir}/checkpoint/state.pt at step {summary['step']}" \
        in again.stdout
    assert not (out / "sweep.lock").exists()
