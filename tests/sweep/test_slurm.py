"""Sweeps on a real one-node Slurm cluster (`bash slurm/cluster.sh start`; CI starts it).

Each test submits through `harness sweep` with `--set launcher.profile=local`, as a user does,
and checks what Slurm and the trial folders say afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import conftest
import psutil
import pytest
from conftest import (
    STEPS_LEFT,
    assert_matches_one_process,
    micro_run,
    train_losses,
    wait_for_step,
    write_yaml,
)
from services import require_service
from submitit.core.utils import cloudpickle_dump

from harness.config.launchers.slurm import SlurmConfig
from harness.methods.resolve import load_run
from harness.sweep.launchers.slurm import submit, wait
from harness.sweep.launchers.slurm_cluster import SlurmCluster
from harness.train import train
from harness.trials import read_json


@pytest.fixture(autouse=True)
def cluster() -> None:
    require_service("HARNESS_SLURM", "the one-node Slurm cluster", "bash slurm/cluster.sh start")


def sweep_file(tmp_path: Path, steps: int, lrs: list[float], **train_keys) -> Path:
    run = micro_run(**{"steps": steps, "log_every": 1, **train_keys})
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 128}
    data.update(name="slurm", methods={"full": {}}, search={"space": {"train.lr": lrs}},
                launcher={"profile": "local"})
    return write_yaml(tmp_path / "slurm.yaml", data)


start_sweep = partial(conftest.start_sweep, stderr=subprocess.STDOUT)  # one stream, in order


def finish(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    return out


def job_of(trial_dir: Path) -> str:
    deadline = time.time() + 60
    while not (trial_dir / "launch.json").exists():
        assert time.time() < deadline
        time.sleep(0.2)
    return read_json(trial_dir / "launch.json")["job_id"]


def only_trial(out: Path) -> Path:
    deadline = time.time() + 60
    while not (out / "trials").is_dir() or not any((out / "trials").iterdir()):
        assert time.time() < deadline
        time.sleep(0.2)
    (trial_dir,) = (out / "trials").iterdir()
    return trial_dir


def wait_past_requeue(trial_dir: Path, steps: int, why: str) -> int:
    """Until the trial's first requeue is recorded (`why` if none is within 300 s), then until
    it has trained `steps` more steps: it resumed and goes on. Returns the step it stopped at."""
    deadline = time.time() + 300
    while (read_json(trial_dir / "summary.json") or {}).get("requeues", 0) < 1:
        assert time.time() < deadline, why
        time.sleep(0.5)
    stopped_at = read_json(trial_dir / "summary.json")["step"]
    wait_for_step(trial_dir, stopped_at + steps)
    return stopped_at


# Without the profile's cpus_per_task (launcher.kind alone): each job gets one CPU of the node.
NO_CPUS_PER_TASK = ("launcher.profile=null", "launcher.kind=slurm")


def test_grid_sweep_runs_as_one_job_array(tmp_path):
    """Three trials as one array, two at once. Without cpus_per_task a job gets one CPU of the
    node (SLURM_CPUS_ON_NODE=1) and sees every core: each trial still runs one thread."""
    out = tmp_path / "runs"
    start = time.time()
    path = sweep_file(tmp_path, 4, [1e-3, 2e-3, 3e-3])
    proc = start_sweep(path, out, "launcher.jobs=2", *NO_CPUS_PER_TASK)
    log = finish(proc)
    assert proc.returncode == 0, log
    trial_dirs = sorted((out / "trials").iterdir())
    jobs = [read_json(d / "launch.json")["job_id"] for d in trial_dirs]
    assert len({j.split("_")[0] for j in jobs}) == 1 and len(set(jobs)) == 3, jobs
    for d in trial_dirs:
        summary = read_json(d / "summary.json")
        assert summary["status"] == "ok" and summary["requeues"] == 0
        assert summary["threads"] == 1
    states = subprocess.run(["sacct", "-n", "-X", "-j", jobs[0].split("_")[0], "-o", "State"],
                            capture_output=True, text=True).stdout.split()
    assert states == ["COMPLETED"] * 3, states
    print(f"3-trial array sweep on Slurm: {time.time() - start:.1f} s")

    again = finish(start_sweep(path, out, *NO_CPUS_PER_TASK))
    assert "3 already finished, 0 to run" in again


def test_preempted_trial_resumes_from_its_checkpoint_with_the_same_losses(tmp_path):
    """USR2 at step 5, and a second one while the trial still writes the first one's checkpoint:
    one requeue, and the resumed trial's losses are an uninterrupted run's."""
    steps = 5 + STEPS_LEFT
    path = sweep_file(tmp_path, steps, [3e-3])
    reference = train(load_run(micro_run(steps=steps, log_every=1) | {
        "eval": {"every": 0, "tokens": 128}}), tmp_path / "reference")
    out = tmp_path / "runs"
    proc = start_sweep(path, out)
    trial_dir = only_trial(out)
    wait_for_step(trial_dir, 5)
    job = job_of(trial_dir)
    preempt(job)
    time.sleep(0.2)
    preempt(job)
    assert_requeued_ok(proc, trial_dir, 1, steps)
    summary = read_json(trial_dir / "summary.json")
    assert train_losses(trial_dir) == train_losses(tmp_path / "reference")
    assert summary["eval_loss"] == reference["eval_loss"]
    logs = "".join(p.read_text() for p in (out / "jobs").glob("*/*_log.out"))
    assert "resumed from" in logs
    assert "signal SIGUSR2 ignored: a requeue is under way" in logs


def test_a_preempted_fsdp_trial_of_two_tasks_resumes_from_its_shards(tmp_path):
    """USR2 reaches both tasks: each rank writes its shards of the checkpoint, the requeued
    job's two ranks read them, and the losses are a 1-process run's (to the reduction order's
    1e-5, as in tests/train/test_fsdp.py). Also what a 2-task fsdp job does unstopped
    (test_a_two_task_job_is_one_ddp_trial's fsdp case, EXHAUSTIVE): rank 0 holds half of
    every row, rank 1 joins over gloo, the eval loss is one process's."""
    # Its two ranks' step is slower than STEPS_LEFT's one-process step, so 60 steps left last
    # as long as STEPS_LEFT aims for. At lr 1e-3 the two runs stay within 4.9e-7 over 64
    # steps; at 3e-3 the reduction order's 1e-7 grew to 1.7e-4 by then (measured).
    out, steps = tmp_path / "runs", 4 + 60
    proc = start_sweep(sweep_file(tmp_path, steps, [1e-3]), out, "launcher.tasks_per_node=2",
                       "train.parallel=fsdp", "train.keep_final=full")  # its shards read below
    trial_dir = only_trial(out)
    wait_for_step(trial_dir, 4)
    preempt(job_of(trial_dir))
    assert_requeued_ok(proc, trial_dir, 1, steps)
    for part in ("model", "optimizer"):  # each task wrote its own shards of each
        assert {p.name for p in (trial_dir / "checkpoint" / "state.pt" / part).glob(
            "*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    single = train(load_run(micro_run(steps=steps, lr=1e-3, log_every=1, parallel="fsdp") | {
        "eval": {"every": 0, "tokens": 128}}), tmp_path / "one")
    one, two = train_losses(tmp_path / "one"), train_losses(trial_dir)
    assert two.keys() == one.keys()
    assert all(abs(two[s] - one[s]) <= 1e-5 * abs(one[s]) for s in one)
    summary = read_json(trial_dir / "summary.json")
    assert summary["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert summary["param_bytes"] == single["param_bytes"] // 2  # rank 0: half of every row
    logs = "".join(p.read_text() for p in (out / "jobs").glob("*/*_log.out"))
    assert "resumed from" in logs
    assert "rank 1/2: gloo" in "".join(p.read_text() for p in (out / "jobs").glob("*/*_log.err"))


def test_a_job_slurm_still_holds_has_not_ended_though_its_result_files_are_there(tmp_path):
    """A requeued job keeps the result files of its run before (a 2-task job's rank 1 writes
    one on preemption, rank 0 an error when the requeue's cancellation kills its `scontrol`):
    the sweep waits until Slurm lets the job go, then reads its last run's result. CI met a
    sweep that ended, its trial unfinished, while that trial's job was requeued."""
    launcher = SlurmConfig(kind="slurm", partition="debug", cpus_per_task=1, timeout_min=5)
    (job,) = submit(launcher, tmp_path / "jobs", [partial(time.sleep, 6)])
    job_id, deadline = str(job.job_id), time.time() + 60
    while SlurmCluster.job_states([job_id]).get(job_id) != "running":
        assert time.time() < deadline, "the job did not start"
        time.sleep(0.2)
    cloudpickle_dump(("success", "the run before's"), job.paths.result_pickle)  # submitit's form
    assert job.done()  # all submitit looks at
    seen = []
    wait([job], lambda _, j: seen.append((SlurmCluster.job_states([job_id]), j.result())),
         slurm=True)
    assert seen == [({}, None)]  # Slurm had let it go; None is time.sleep's, its last run's


def test_a_trial_at_its_time_limit_is_requeued_and_resumes(tmp_path):
    """Slurm checks limits every 30 s: with timeout_min=2 and a 50 s signal delay, USR2 comes
    40-70 s in (an 80 s delay sent it 26 s in), when the trial trains (its first steps came
    about 20 s in). The trial is too long to finish; once it has resumed, the job is
    cancelled."""
    out = tmp_path / "runs"
    path = sweep_file(tmp_path, 1_000_000, [3e-3], log_every=10)
    proc = start_sweep(path, out, "launcher.timeout_min=2", "launcher.signal_delay_s=50")
    trial_dir = only_trial(out)
    job = job_of(trial_dir)
    stopped_at = wait_past_requeue(trial_dir, 20, "no requeue at the time limit")
    subprocess.run(["scancel", job], check=True)
    proc.terminate()
    finish(proc)
    steps = sorted(train_losses(trial_dir))
    assert steps == list(range(10, steps[-1] + 1, 10))  # resumed where it stopped: no gap
    logs = "".join(p.read_text() for p in (out / "jobs").glob("*/*_log.out"))
    assert f"resumed from {trial_dir / 'checkpoint' / 'state.pt'} at step {stopped_at}" in logs


def test_a_sigkilled_trial_is_recorded_killed_and_the_sweep_ends(tmp_path):
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 10_000, [3e-3]), out)
    trial_dir = only_trial(out)
    wait_for_step(trial_dir, 2)
    os.kill(read_json(trial_dir / "summary.json")["pid"], signal.SIGKILL)
    log = finish(proc, timeout_s=300)
    assert proc.returncode == 1, log
    summary = read_json(trial_dir / "summary.json")
    assert summary["status"] == "killed"
    assert summary["error"] == "trial process killed by signal 9 (SIGKILL)"


def test_optuna_workers_run_as_array_tasks(tmp_path):
    import optuna

    from harness.sweep.search.study import open_storage

    path = sweep_file(tmp_path, 4, [3e-3])
    out = tmp_path / "runs"
    proc = start_sweep(path, out, "launcher.jobs=2", "search.sampler=random", "search.n_trials=3",
                       "search.space={train.lr: {low: 0.001, high: 0.01, log: true}}")
    log = finish(proc)
    assert proc.returncode == 0, log
    assert "submitted 2 workers" in log
    study = optuna.load_study(study_name="slurm/full",
                              storage=open_storage(str(out / "optuna.journal")))
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    ids = {t.user_attrs["trial_id"] for t in trials}
    assert ids == {d.name for d in (out / "trials").iterdir()}


# fsdp's 2-task job: the preempted one above trains it, to the same checks and more
EXHAUSTIVE = {"test_a_two_task_job_is_one_ddp_trial": {("fsdp",)}}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_two_task_job_is_one_ddp_trial(tmp_path, parallel):
    """tasks_per_node=2: Slurm starts two tasks; each gives its trial process torchrun's
    variables from submitit's environment, and the trial (DDP, or FSDP2's shards) equals a
    1-process run."""
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 4, [3e-3]), out, "launcher.tasks_per_node=2",
                       f"train.parallel={parallel}")
    log = finish(proc)
    assert proc.returncode == 0, log
    trial_dir = only_trial(out)
    run = micro_run(steps=4, lr=3e-3, log_every=1, parallel=parallel) | {
        "eval": {"every": 0, "tokens": 128}}
    assert_matches_one_process(trial_dir, run, tmp_path / "single")
    held, whole = (read_json(d / "summary.json")["param_bytes"] for d in (trial_dir,
                                                                         tmp_path / "single"))
    assert held == (whole // 2 if parallel == "fsdp" else whole)  # rank 0: half of every row
    ranks = "".join(p.read_text() for p in (out / "jobs").glob("*/*_log.err"))
    assert "rank 1/2: gloo" in ranks


def preempt(job: str) -> None:
    subprocess.run(["scancel", "--signal=USR2", job], check=True)


def assert_requeued_ok(proc: subprocess.Popen, trial_dir: Path, requeues: int,
                       steps: int) -> None:
    log = finish(proc)
    assert proc.returncode == 0, log
    summary = read_json(trial_dir / "summary.json")
    assert (summary["status"], summary["requeues"], summary["step"]) == ("ok", requeues, steps)
    assert sorted(train_losses(trial_dir)) == list(range(1, steps + 1))  # no step lost


def test_a_signal_during_a_checkpoint_write_and_a_second_preemption_after_the_requeue(
        tmp_path):
    """USR2 while the trial writes a periodic checkpoint; once the requeued job has resumed,
    another preemption: two requeues, and the trial ends ok with every step logged."""
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 40, [3e-3], checkpoint_every=1), out)
    trial_dir = only_trial(out)
    wait_for_step(trial_dir, 3)
    job = job_of(trial_dir)
    deadline = time.time() + 120
    while not any((trial_dir / "checkpoint").glob(".*.tmp*")):  # a write under way
        assert time.time() < deadline, "never saw a checkpoint being written"
        time.sleep(0.002)
    preempt(job)
    wait_past_requeue(trial_dir, 3, "no requeue")
    preempt(job)
    assert_requeued_ok(proc, trial_dir, 2, 40)


def test_a_signal_while_the_trial_process_starts_makes_one_requeue(tmp_path):
    """USR2 as soon as the job's trial process exists (still importing torch, no handler of
    its own yet): it is not killed by the signal; the job requeues once and the trial ends ok."""
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 10, [3e-3]), out)
    trial_dir = only_trial(out)
    job = job_of(trial_dir)
    deadline = time.time() + 120
    while not any(str(trial_dir) in " ".join(p.info["cmdline"] or [])
                  for p in psutil.process_iter(["cmdline"])):
        assert time.time() < deadline, "the trial process never started"
        time.sleep(0.01)
    preempt(job)
    assert_requeued_ok(proc, trial_dir, 1, 10)


def test_harness_train_started_by_srun_runs_the_threads_of_its_cpus(tmp_path):
    """`srun -n1 -c1 harness train`: this cluster does not bind the task to its CPU, so torch
    alone would start a thread per core of the node (2 here); the trial follows its grant."""
    assert len(os.sched_getaffinity(0)) >= 2, "needs a node of 2 or more cores"
    config = write_yaml(tmp_path / "run.yaml", micro_run(steps=1, log_every=1))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(
        ["srun", "-n1", "-c1", sys.executable, "-m", "harness.cli", "train", str(config),
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, cwd=conftest.REPO, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert read_json(tmp_path / "run" / "summary.json")["threads"] == 1
