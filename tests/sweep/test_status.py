"""Trial status without a cluster: Slurm is asked once per call, whatever the trial count."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.config import SweepConfig
from harness.sweep.launchers import slurm_cluster as status_module
from harness.sweep.launchers.slurm_cluster import SlurmCluster
from harness.sweep.plan.expand import expand, load_sweep
from harness.sweep.run.trial_state import trial_statuses
from harness.sweep.search.grid import GridSource
from harness.sweep.search.study_source import StudySearch
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
    assert squeue.calls == [] and SlurmCluster.job_states([]) == {}


def test_squeue_missing_or_failing_means_no_live_job(tmp_path, monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("squeue")

    monkeypatch.setattr(status_module.subprocess, "run", missing)
    trial = slurm_trial(RunsDir(tmp_path), "t", "9_0", "interrupted")
    assert trial_statuses([trial]) == ["interrupted"]


def test_harness_status_loads_all_trials_with_one_squeue(tmp_path, monkeypatch):
    """What `harness status` and `report` run: the table's status column, one squeue."""
    from harness import cli_sweep

    runs = RunsDir(tmp_path / "runs")
    for i in range(5):
        trial = slurm_trial(runs, f"full-{i}", f"800_{i}", "pending")
        trial.config.write_text("name: s\nlabel: full\nmethod: {name: full}\n")
    squeue = FakeSqueue({f"800_{i}": "PENDING" for i in range(5)})
    monkeypatch.setattr(status_module.subprocess, "run", squeue)
    table = cli_sweep.load_trials(str(runs.path))
    assert len(squeue.calls) == 1
    assert list(table["status"]) == ["queued"] * 5


DAMAGED = '{"trial": "full-x", "status": "ok", "eval_'  # cut short: the string opens at 37
WHY = "not JSON (Unterminated string starting at: line 1 column 37, 42 bytes)"


def test_an_unreadable_summary_is_not_pending_unless_its_job_lives(tmp_path, monkeypatch):
    """A damaged summary.json is `unreadable`; a live Slurm job says more (its trial writes a
    new summary), so Slurm is asked about it as about a pending one."""
    squeue = FakeSqueue({"900_1": "PENDING"})
    monkeypatch.setattr(status_module.subprocess, "run", squeue)
    runs = RunsDir(tmp_path)
    gone, queued = slurm_trial(runs, "gone", "900_0", None), slurm_trial(runs, "q", "900_1", None)
    for trial in (gone, queued):
        trial.summary.write_text(DAMAGED)
    assert trial_statuses([gone, queued]) == ["unreadable", "queued"]
    assert sorted(squeue.calls[0][squeue.calls[0].index("-j") + 1].split(",")) == [
        "900_0", "900_1"]


def test_harness_status_names_each_unreadable_record(tmp_path, monkeypatch, capsys):
    """`harness status`: the row says `unreadable`, a line after the table names the file and
    why; `--json` carries it in `error`."""
    from harness import cli

    monkeypatch.setattr(status_module.subprocess, "run", FakeSqueue({}))
    runs = RunsDir(tmp_path / "runs")
    for name, summary in (("full-a", '{"trial": "full-a", "status": "ok"}'), ("full-x", DAMAGED)):
        trial = runs.trial(name)
        trial.path.mkdir(parents=True)
        trial.config.write_text("name: s\nlabel: full\nmethod: {name: full}\ntrain: {steps: 4}\n")
        trial.summary.write_text(summary)
    assert cli.main(["status", str(runs.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    (row,) = [line for line in out if line.startswith("| full-x ")]
    assert row.split("|")[4].strip() == "unreadable"
    assert out[-1] == f"unreadable: full-x ({runs.trial('full-x').summary}: {WHY})"
    assert cli.main(["status", str(runs.path), "--json"]) == 0
    records = {r["trial"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["full-x"]["status"] == "unreadable"
    assert records["full-x"]["error"] == f"{runs.trial('full-x').summary}: {WHY}"
    assert records["full-a"]["status"] == "ok" and records["full-a"]["error"] is None


def grid(tmp_path: Path) -> tuple[SweepConfig, list]:
    """Two trials of a grid, both with an `ok` summary written by hand: nothing trains."""
    path = tmp_path / "grid.yaml"
    path.write_text("name: g\nmodel: llama_micro\ntask: {dataset: sample, tokenizer: sample}\n"
                    "methods: {full: {}}\nsearch: {space: {train.lr: [0.001, 0.003]}}\n")
    sweep = load_sweep(path, {})
    trials = expand(sweep)
    for t in trials:
        RunsDir(tmp_path / "runs").trial(t.id).write_summary({"trial": t.id, "status": "ok"})
    return sweep, trials


def test_a_sweep_names_an_unreadable_trial_and_reruns_it_only_when_asked(tmp_path, capsys):
    """The grid's trials to run (GridSource.unfinished): a trial whose summary cannot be read
    may hold a result, so it counts as failed, is not trained over, and the sweep names it;
    with --retry-failed it runs again."""
    sweep, (_, damaged) = grid(tmp_path)
    out = tmp_path / "runs"
    trial = RunsDir(out).trial(damaged.id)
    trial.summary.write_text(DAMAGED)
    dirs = [RunsDir(out).trial(t.id) for t in expand(sweep)]
    source, live, failed = GridSource.unfinished(expand(sweep), dirs, retry_failed=False)
    assert len(source) == 0 and live == 0 and len(dirs) == 2 and failed == 1
    assert capsys.readouterr().err == (
        f"unreadable: {damaged.id} ({trial.summary}: {WHY}): counted as failed and not run "
        "again; fix the file, or pass --retry-failed to train the trial again\n")
    assert trial.summary.read_text() == DAMAGED  # nothing written over it
    source, _, failed = GridSource.unfinished(expand(sweep), dirs, retry_failed=True)
    assert failed == 0  # each failed one runs again
    assert [pick_id for pick_id, _ in source.assigned] == [damaged.id]
    assert capsys.readouterr().err == (
        f"unreadable: {damaged.id} ({trial.summary}: {WHY}): running it again (--retry-failed), "
        "from its newest checkpoint if it has one; the file goes to summary.json.corrupt\n")


def test_a_search_sweep_names_an_unreadable_trial_as_it_opens_its_studies(tmp_path, capsys):
    """A search's trials come from its studies, not a grid: the sweep still names each trial
    folder whose summary cannot be read, and writes nothing over it."""
    path = tmp_path / "search.yaml"
    path.write_text("name: s\nmodel: llama_micro\ntask: {dataset: sample, tokenizer: sample}\n"
                    "methods: {full: {}}\nsearch: {sampler: tpe, n_trials: 2}\n")
    out = tmp_path / "runs"
    trial = RunsDir(out).trial("full-x")
    trial.summary.parent.mkdir(parents=True)
    trial.summary.write_text(DAMAGED)
    StudySearch(load_sweep(path, {}), out).open_studies(retry_failed=False)
    err = capsys.readouterr().err
    assert f"unreadable: full-x ({trial.summary}: {WHY}): its study keeps" in err
    assert trial.summary.read_text() == DAMAGED
