"""`harness dashboard`: optuna-dashboard on a sweep's own journal, bound to 127.0.0.1, opened in
headless Chromium (a service: fails in CI without it, as tests/analysis/test_html.py)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from conftest import chromium, free_port, headless, write_yaml

from harness.errors import UserError
from harness.sweep.dashboard import storage_of
from harness.sweep.study import open_storage

VALUES = [(310.0, 2.0e7), (290.0, 2.6e7), (330.0, 1.8e7), (320.0, 2.7e7)]  # the last: dominated


def search_runs(out: Path) -> Path:
    """A multi-objective search sweep's folder: its sweep.yaml and a study of four told trials."""
    write_yaml(out / "sweep.yaml", {"name": "mo", "methods": {"full": {}},
                                    "search": {"sampler": "tpe", "n_trials": 4}})
    study = optuna.create_study(study_name="mo/full", directions=["minimize", "minimize"],
                                storage=open_storage(str(out / "optuna.journal")))
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    for i, values in enumerate(VALUES):
        study.add_trial(optuna.trial.create_trial(
            params={"train.lr": 1e-3 * (i + 1)}, distributions={"train.lr": lr},
            values=list(values), user_attrs={"trial_id": f"full-{i}"}))
    return out


def test_grid_sweeps_and_empty_folders_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match=r"no sweep\.yaml here"):
        storage_of(tmp_path)
    write_yaml(tmp_path / "sweep.yaml", {"name": "g", "methods": {"full": {}}})
    with pytest.raises(UserError, match="a grid sweep keeps no Optuna study"):
        storage_of(tmp_path)
    write_yaml(tmp_path / "sweep.yaml", {"name": "s", "methods": {"full": {}},
                                         "search": {"sampler": "tpe"}})
    with pytest.raises(UserError, match=r"optuna\.journal does not exist yet"):
        storage_of(tmp_path)


def test_the_dashboard_shows_the_study_its_trials_and_the_pareto_front(tmp_path):
    runs = search_runs(tmp_path / "runs")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "harness.cli", "dashboard", str(runs),
                               "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}/dashboard"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base, timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no dashboard"
                time.sleep(0.5)
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
    assert f"http://127.0.0.1:{port}/dashboard" in output


class _Url(str):
    """A URL where `headless` takes a page path (it calls `as_uri()`)."""

    def as_uri(self) -> str:
        return str(self)
