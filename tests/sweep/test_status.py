"""Trial status without a cluster: Slurm is asked once per call, whatever the trial count."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.sweep import trial_state as status_module
from harness.sweep.trial_state import slurm_states, trial_statuses
from harness.trials import RunsDir, TrialDir


class FakeSqueue:
    """Stands for `subprocess.run`: counts the calls and lists the given jobs as Slurm would."""

    def __init__(self, listed: dict[str, str]) -> None:
        self.listed, self.calls = listed, []

    def __call__(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        self.calls.append(args)
        asked = args[args.index("-j") + 1].split(",")
        out = "".join(f"{j} {s}\n" for j, s in self.listed.items() if j in asked)
        return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")


def slurm_trial(runs: RunsDir, name: str, job_id: str, status: str | None) -> TrialDir:
    trial = runs.trial(name)
    trial.record_launch("slurm", job_id)
    if status is not None:
        trial.write_summary({"trial": name, "status": status})
    return trial


def test_one_squeue_for_all_the_slurm_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    runs = RunsDir(tmp_path)
    n = 40
    states = {f"700_{i}": "PENDING" if i % 2 else "RUNNING" for i in range(n - 10)}
    squeue = FakeSqueue(states)
    monkeypatch.setattr(status_module.subprocess, "run", squeue)
    trials = [slurm_trial(runs, f"t{i}", f"700_{i}", None if i % 3 else "interrupted")
              for i in range(n)]
    trials.append(slurm_trial(runs, "done", "700_99", "ok"))  # finished: Slurm is not asked
    got = trial_statuses(trials)
    assert len(squeue.calls) == 1
    (args,) = squeue.calls
    assert args[:2] == ["squeue", "-h"] and "-r" in args
    assert sorted(args[args.index("-j") + 1].split(",")) == sorted(f"700_{i}" for i in range(n))
    expected = [("queued" if i % 2 else "running") if i < n - 10
                else ("interrupted" if i % 3 == 0 else "pending") for i in range(n)]
    assert got == [*expected, "ok"]
    assert all(type(s) is str for s in got)


def test_no_squeue_without_a_slurm_trial_to_ask_about(tmp_path, monkeypatch):
    squeue = FakeSqueue({})
    monkeypatch.setattr(status_module.subprocess, "run", squeue)
    runs = RunsDir(tmp_path)
    local = runs.trial("local")
    local.record_launch("local")
    local.write_summary({"trial": "local", "status": "running", "pid": 0})
    finished = slurm_trial(runs, "finished", "5", "nan")
    assert trial_statuses([local, finished, runs.trial("never")]) == [
        "interrupted", "nan", "pending"]
    assert squeue.calls == [] and slurm_states([]) == {}


def test_squeue_missing_or_failing_means_no_live_job(tmp_path, monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("squeue")

    monkeypatch.setattr(status_module.subprocess, "run", missing)
    trial = slurm_trial(RunsDir(tmp_path), "t", "9_0", "interrupted")
    assert trial_statuses([trial]) == ["interrupted"]


def test_harness_status_loads_all_trials_with_one_squeue(tmp_path, monkeypatch):
    """What `harness status` and `report` run: the table's status column, one squeue."""
    from harness import cli

    runs = RunsDir(tmp_path / "runs")
    for i in range(5):
        trial = slurm_trial(runs, f"full-{i}", f"800_{i}", "pending")
        trial.config.write_text("name: s\nlabel: full\nmethod: {name: full}\n")
    squeue = FakeSqueue({f"800_{i}": "PENDING" for i in range(5)})
    monkeypatch.setattr(status_module.subprocess, "run", squeue)
    table = cli._load(str(runs.path))
    assert len(squeue.calls) == 1
    assert list(table["status"]) == ["queued"] * 5
