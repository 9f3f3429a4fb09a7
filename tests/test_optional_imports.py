"""The harness without wandb and the PostgreSQL client, as the GPU kit installs it
(docs/gpu_kit.md): each is imported only where it is used, so every module loads, and train,
an Optuna sweep on SQLite and estimate run. Heavy modules a process may not need are imported
where used too: a job's interpreter does not load torch's FSDP stack or pandas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, micro_run, write_yaml

from harness.trials import read_json

ABSENT = ("wandb", "psycopg2")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment in whose Python processes, children included, they are not installed: a
    sitecustomize puts None in sys.modules for each, so `import` raises ModuleNotFoundError
    and `importlib.util.find_spec` answers None, as for a package that is not there."""
    site = tmp_path / "site"
    site.mkdir()
    prelude = f"import sys\nsys.modules.update(dict.fromkeys({ABSENT}))\n"
    (site / "sitecustomize.py").write_text(prelude)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_every_module_loads_without_them(env):
    code = f"""
import importlib, importlib.util, pkgutil
import harness, harness.analysis, harness.methods
assert not any(importlib.util.find_spec(m) for m in {ABSENT})  # the environment is as said
for pkg in (harness, harness.analysis, harness.methods):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
"""
    run(env, "-c", code)


def test_train_without_them(env, tmp_path):
    config = write_yaml(tmp_path / "run.yaml", micro_run(steps=2))
    run(env, "-m", "harness.cli", "train", str(config), "--out", str(tmp_path / "run"))
    assert read_json(tmp_path / "run" / "summary.json")["status"] == "ok"


def test_sweep_on_sqlite_without_them(env, tmp_path):
    data = {k: v for k, v in micro_run(steps=2).items() if k in ("model", "task", "train")}
    data.update(name="absent", eval={"every": 0, "tokens": 64}, methods={"full": {}},
                storage=f"sqlite:///{tmp_path / 'optuna.db'}",
                search={"sampler": "random", "n_trials": 1,
                        "space": {"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}})
    sweep = write_yaml(tmp_path / "absent.yaml", data)
    run(env, "-m", "harness.cli", "sweep", str(sweep), "--out", str(tmp_path / "runs"))
    (summary,) = (tmp_path / "runs").glob("trials/*/summary.json")
    assert read_json(summary)["status"] == "ok"


def test_estimate_without_them(env):
    table = run(env, "-m", "harness.cli", "estimate", "sweeps/quickstart.yaml").stdout
    assert all(f"\n{m} " in table for m in ("full", "adam8bit", "qgalore"))  # a row each


HEAVY = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
         "pandas")


def test_a_jobs_interpreter_leaves_the_fsdp_stack_and_pandas_unloaded():
    """What submitit's job interpreter and the CLI import (harness.sweep.run.worker, harness.cli)
    loads none of them: harness/distributed/fsdp.py and harness/cost/estimate.py import them
    where used, a large share of every job's start."""
    code = (f"import sys, harness.cli, harness.sweep.run.worker\n"
            f"print(sorted(m for m in {HEAVY} if m in sys.modules))")
    assert run(dict(os.environ), "-c", code).stdout.strip() == "[]"


def test_a_presets_preflight_and_estimate_leave_transformers_unloaded(tmp_path):
    """The sweep process's disk preflight and `harness estimate` read a preset's shapes written
    out (harness/models.py `preset_shapes`): building the model imported transformers'
    modeling, seconds of CPU for every sweep."""
    code = f"""
import sys
from pathlib import Path
from harness.cli import main
from harness.sweep.plan.expand import load_sweep
from harness.sweep.plan.forecast import check_disk
from harness.sweep.search.open import open_search
sweep = load_sweep("sweeps/quickstart.yaml", {{}})
check_disk(sweep.launcher, open_search(sweep, Path({str(tmp_path)!r})).left(False),
           Path({str(tmp_path)!r}))
main(["estimate", "sweeps/quickstart.yaml"])
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    done = run(dict(os.environ), "-c", code)
    assert "\nqgalore " in done.stdout and done.stdout.splitlines()[-1] == "[]"


def test_the_tables_status_and_estimate_print_leave_matplotlib_and_scipy_unloaded(finished_run):
    """The trials table `harness status` prints (analysis/status.py), and
    `harness estimate` beside GaLore's Table 2 (its CSV in harness.analysis): the package loads
    the report's figures only when they are asked for, most of such a process's imports."""
    code = f"""
import sys
from harness.cli import main
main(["status", {str(finished_run)!r}])
main(["estimate", "sweeps/c4_1b.yaml"])
print(sorted(m for m in ("matplotlib", "scipy") if m in sys.modules))
"""
    done = run(dict(os.environ), "-c", code)
    assert "| ok " in done.stdout and "Table 2" in done.stdout, done.stdout[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"
