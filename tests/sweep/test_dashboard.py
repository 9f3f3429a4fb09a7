"""`harness dashboard`: optuna-dashboard on a sweep's own journal, bound to 127.0.0.1, opened in
headless Chromium (a service: fails in CI without it, as tests/analysis/test_html.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from conftest import free_port, micro_run, write_yaml
from services import chromium, headless, require_service

from harness.errors import UserError
from harness.sweep.plan.expand import load_sweep
from harness.sweep.search.dashboard import name_objectives, storage_of, sweep_of
from harness.sweep.search.study import open_storage, open_study

VALUES = [(310.0, 2.0e7), (290.0, 2.6e7), (330.0, 1.8e7), (320.0, 2.7e7)]  # the last: dominated


def search_runs(out: Path, storage: str | None = None, name: str = "mo") -> Path:
    """A multi-objective search sweep's folder: its sweep.yaml and a study of four told trials
    in its journal, or in the database `storage` names."""
    write_yaml(out / "sweep.yaml", {"name": name, "methods": {"full": {}}, "storage": storage,
                                    "search": {"sampler": "tpe", "n_trials": 4}})
    study = optuna.create_study(study_name=f"{name}/full", directions=["minimize", "minimize"],
                                storage=open_storage(storage or str(out / "optuna.journal")))
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    for i, values in enumerate(VALUES):
        study.add_trial(optuna.trial.create_trial(
            params={"train.lr": 1e-3 * (i + 1)}, distributions={"train.lr": lr},
            values=list(values), user_attrs={"trial_id": f"full-{i}"}))
    return out


def test_grid_sweeps_and_empty_folders_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match=r"no sweep\.yaml here"):
        sweep_of(tmp_path)
    write_yaml(tmp_path / "sweep.yaml", {"name": "g", "methods": {"full": {}}})
    with pytest.raises(UserError, match="a grid sweep keeps no Optuna study"):
        storage_of(tmp_path, sweep_of(tmp_path))
    write_yaml(tmp_path / "sweep.yaml", {"name": "s", "methods": {"full": {}},
                                         "search": {"sampler": "tpe"}})
    with pytest.raises(UserError, match=r"optuna\.journal does not exist yet"):
        storage_of(tmp_path, sweep_of(tmp_path))


OBJECTIVES = [{"metric": "eval_ppl"}, {"metric": "peak_memory_bytes"}]


def test_a_studys_objectives_carry_their_metric_names(tmp_path):
    """optuna-dashboard titles an axis by the study's metric names, "Objective 0" without them:
    a sweep names them as it opens its study, and the dashboard names those of older studies."""
    run = micro_run(steps=2)
    path = write_yaml(tmp_path / "mo.yaml", {
        **{k: run[k] for k in ("model", "task", "train")}, "name": "mo",
        "methods": {"full": {}}, "search": {"sampler": "tpe", "n_trials": 2,
                                            "objectives": OBJECTIVES}})
    storage = open_storage(str(tmp_path / "new.journal"))
    opened = open_study(load_sweep(path, {}), "full", storage)
    assert opened.metric_names == ["eval_ppl", "peak_memory_bytes"]
    assert optuna.load_study(study_name="mo/full", storage=storage).metric_names == [
        "eval_ppl", "peak_memory_bytes"]
    runs = search_runs(tmp_path / "runs")  # a study created without names
    write_yaml(runs / "sweep.yaml", {"name": "mo", "methods": {"full": {}},
                                     "search": {"sampler": "tpe", "objectives": OBJECTIVES}})
    storage = open_storage(str(runs / "optuna.journal"))
    assert optuna.load_study(study_name="mo/full", storage=storage).metric_names is None
    name_objectives(sweep_of(runs), storage)
    assert optuna.load_study(study_name="mo/full", storage=storage).metric_names == [
        "eval_ppl", "peak_memory_bytes"]


def start(runs: Path) -> tuple[subprocess.Popen, str]:
    """`harness dashboard RUNS` on a free port, once it answers; its base URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "harness.cli", "dashboard", str(runs),
                               "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/dashboard", timeout=5)
            return server, base
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(f"no dashboard: {server.communicate()[0]}") from None
            time.sleep(0.5)


def test_the_dashboard_shows_the_study_its_trials_and_the_pareto_front(tmp_path):
    runs = search_runs(tmp_path / "runs")
    server, base = start(runs)
    base += "/dashboard"
    try:
        study_id = open_storage(str(runs / "optuna.journal")).get_study_id_from_name("mo/full")
        browser, profile = chromium(), tmp_path / "profile"
        studies = headless(browser, _Url(base), profile, "--dump-dom",
                           "--virtual-time-budget=20000")
        assert "mo/full" in studies
        page = headless(browser, _Url(f"{base}/studies/{study_id}"), profile, "--dump-dom",
                        "--virtual-time-budget=20000")
        assert "Pareto Front" in page
        trials = headless(browser, _Url(f"{base}/studies/{study_id}/trials"), profile,
                          "--dump-dom", "--virtual-time-budget=20000")
        assert all(f"Trial {n}" in trials for n in range(len(VALUES)))
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert base in output


def test_the_dashboard_names_each_objective_by_its_metric(tmp_path):
    """What the dashboard's pages read (its study API): the metric names, not "Objective 0"."""
    runs = search_runs(tmp_path / "runs")  # a study created without names
    write_yaml(runs / "sweep.yaml", {"name": "mo", "methods": {"full": {}},
                                     "search": {"sampler": "tpe", "objectives": OBJECTIVES}})
    server, base = start(runs)
    try:
        study_id = open_storage(str(runs / "optuna.journal")).get_study_id_from_name("mo/full")
        detail = json.load(urllib.request.urlopen(f"{base}/api/studies/{study_id}", timeout=30))
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert detail["objective_names"] == ["eval_ppl", "peak_memory_bytes"]


def test_the_dashboard_reads_a_postgresql_storage(tmp_path):
    """A sweep whose `storage:` is a database: the dashboard lists its study (optuna-dashboard's
    own API, which its pages read)."""
    url = require_service("HARNESS_PG_URL", "a PostgreSQL server", "bash scripts/postgres.sh start")
    name = f"dash{time.time_ns()}"
    server, base = start(search_runs(tmp_path / "runs", url, name))
    try:
        studies = json.load(urllib.request.urlopen(f"{base}/api/studies", timeout=30))
    finally:
        server.terminate()
        server.communicate(timeout=30)
    mine = [s for s in studies["study_summaries"] if s["study_name"] == f"{name}/full"]
    assert len(mine) == 1 and len(mine[0]["directions"]) == 2


class _Url(str):
    """A URL where `headless` takes a page path (it calls `as_uri()`)."""

    def as_uri(self) -> str:
        return str(self)
