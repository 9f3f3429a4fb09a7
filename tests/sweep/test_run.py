"""The one worker loop on a fake `run_trial`: grid and Optuna sources, and the submitit job's
requeue, without training anything."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import optuna
from conftest import micro_run, write_yaml

from harness.sweep.launchers.slurm_job import TrialJob
from harness.sweep.plan.expand import load_sweep
from harness.sweep.run.worker import Worker
from harness.sweep.search.grid import GridSource
from harness.sweep.search.source import Pick
from harness.sweep.search.study import open_storage
from harness.sweep.search.study_source import StudySource
from harness.trials import RunsDir, TrialDir


def search_sweep(tmp_path: Path, n_trials: int = 3):
    run = micro_run(steps=2)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data.update(name="s", methods={"full": {}}, search={
        "sampler": "random", "n_trials": n_trials,
        "space": {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}}})
    return load_sweep(write_yaml(tmp_path / "s.yaml", data), {})


def finishing(status: str = "ok", ran: list[str] | None = None):
    """A run_trial that writes the summary a trial would end with."""

    def run_trial(trial_id: str, trial_dir: Path) -> int:
        if ran is not None:
            ran.append(trial_id)
        TrialDir(trial_dir).write_summary({"trial": trial_id, "status": status,
                                           "eval_ppl": 10.0 + len(ran or [])})
        return 0 if status == "ok" else 7

    return run_trial


def study_trials(sweep, out: Path) -> list[optuna.trial.FrozenTrial]:
    storage = open_storage(str(RunsDir(out).journal))
    return optuna.load_study(study_name="s/full", storage=storage).get_trials()


def test_a_grid_source_hands_each_trial_out_once_across_threads(tmp_path):
    trials = [(f"t{i}", tmp_path / f"t{i}") for i in range(200)]
    source, got, lock = GridSource(trials), [], threading.Lock()

    def take() -> None:
        while (pick := source.next()) is not None:
            with lock:
                got.append(pick.id)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(t for t, _ in trials) and len(source) == 0


def test_the_worker_runs_a_grid_and_keeps_going_past_a_failed_trial(tmp_path):
    source = GridSource([("a", tmp_path / "a"), ("b", tmp_path / "b")])
    ran: list[str] = []
    codes = iter([3, 0])

    def run_trial(trial_id: str, trial_dir: Path) -> int:
        ran.append(trial_id)
        return next(codes)

    assert Worker(source, run_trial).run() == 0  # the last trial's code
    assert ran == ["a", "b"]
    assert [s.assigned for s in GridSource(source.trials).split()] == [
        [("a", tmp_path / "a")], [("b", tmp_path / "b")]]


def test_a_study_source_asks_runs_and_tells_until_the_budget_is_spent(tmp_path):
    sweep, out = search_sweep(tmp_path), tmp_path / "runs"
    ran: list[str] = []
    lock = threading.Lock()
    workers = [Worker(StudySource(sweep, out, i, lock), finishing("ok", ran)) for i in range(2)]
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trials = study_trials(sweep, out)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert sorted(ran) == sorted(t.user_attrs["trial_id"] for t in trials)
    for t in trials:
        trial = RunsDir(out).trial(t.user_attrs["trial_id"])
        assert trial.read_config()["train"]["lr"] == t.params["train.lr"]
        link = TrialDir(trial).optuna_link.read_text()
        assert '"study": "s/full"' in link and f'"trial": {t.number}' in link
    again: list[str] = []
    assert Worker(StudySource(sweep, out, 0), finishing("ok", again)).run() == 0
    assert again == []  # the budget is spent


def test_an_unfinished_trial_stops_the_worker_and_stays_running(tmp_path):
    sweep, out = search_sweep(tmp_path), tmp_path / "runs"
    ran: list[str] = []
    assert Worker(StudySource(sweep, out, 0), finishing("interrupted", ran)).run() == 7
    assert len(ran) == 1
    assert [t.state.name for t in study_trials(sweep, out)] == ["RUNNING"]


def test_a_requeued_job_counts_the_requeue_and_resumes_its_trial_first(tmp_path):
    sweep, out = search_sweep(tmp_path, n_trials=2), tmp_path / "runs"
    job = TrialJob(StudySource(sweep, out, 0))
    stopped: list[Pick] = []

    def preempted(trial_id: str, trial_dir: Path) -> int:
        """What USR2 does: the trial saves its checkpoint and submitit calls `checkpoint`."""
        TrialDir(trial_dir).write_summary({"trial": trial_id, "status": "interrupted"})
        stopped.append(job.worker.current)
        return job.checkpoint()

    job.worker = Worker(job.source, preempted)
    resubmitted = job.worker.run()
    (pick,) = stopped
    assert TrialDir(pick.dir).read_summary().get("requeues") == 1
    requeued = pickle.loads(pickle.dumps(resubmitted.function))  # as submitit sends it
    assert isinstance(requeued, TrialJob) and requeued.source.resume == ("full", pick.number)

    ran: list[str] = []
    requeued.worker = Worker(requeued.source, finishing("ok", ran))
    requeued.worker.run()
    assert ran[0] == pick.id  # the stopped trial first, then the budget's rest
    assert [t.state.name for t in study_trials(sweep, out)] == ["COMPLETE"] * 2


def test_a_requeued_grid_job_resumes_its_one_trial(tmp_path):
    trial_dir = tmp_path / "t"
    TrialDir(trial_dir).write_summary({"trial": "t", "status": "running", "requeues": 0})
    job = TrialJob(trial_dir)
    assert job.source.assigned == [("t", trial_dir)]
    job.worker = Worker(job.source, lambda *_: 0)
    assert job.source.next() == Pick("t", trial_dir)
    job.worker.current = Pick("t", trial_dir)
    requeued = pickle.loads(pickle.dumps(job.checkpoint().function))
    assert TrialDir(trial_dir).read_summary().get("requeues") == 1
    assert requeued.source.next() == Pick("t", trial_dir) and requeued.source.next() is None
