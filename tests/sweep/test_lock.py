"""One sweep at a time in a runs folder: a second is refused naming the holder, a lock whose
holder is gone is taken over (its process ended here; untouched for STALE_S from another
host), and a sweep sharing a database study takes none."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import psutil
import pytest
from conftest import harness_here, micro_run, start_sweep, wait_for_step, write_yaml

from harness.errors import UserError
from harness.sweep.plan.expand import load_sweep
from harness.sweep.run import lock
from harness.sweep.run.lock import hold
from harness.sweep.search.open import open_search


def write_lock(out: Path, host: str, pid: int, process_start: float, age_s: float = 0) -> Path:
    """A lock as a sweep writes it, last touched `age_s` ago."""
    path = out / "sweep.lock"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "process_start": process_start,
                                "since": time.time() - 3600, "slurm_job": None,
                                "command": "harness sweep s.yaml --out runs"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def ended_pid() -> int:
    """A pid no process has now, as a crashed sweep's."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


def held_by(path: Path) -> int:
    return json.loads(path.read_text())["pid"]


def test_a_lock_whose_process_has_ended_is_taken_over_and_released(tmp_path, capsys):
    path = write_lock(tmp_path, socket.gethostname(), ended_pid(), 1.0)
    with hold(tmp_path):
        assert held_by(path) == os.getpid()
    assert not path.exists()
    assert "taking over from a sweep that is gone" in capsys.readouterr().out


def test_a_live_sweep_here_is_refused_in_one_line_naming_it(tmp_path):
    me = psutil.Process()
    path = write_lock(tmp_path, socket.gethostname(), me.pid, me.create_time())
    with pytest.raises(UserError) as refused, hold(tmp_path):
        pass
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path} is in use by another sweep: pid {me.pid} on "
                              f"{socket.gethostname()} since ")
    assert "(harness sweep s.yaml --out runs)" in message and f"`kill {me.pid}`" in message
    assert held_by(path) == me.pid  # left as it was


def test_the_same_pid_started_later_is_another_process(tmp_path):
    me = psutil.Process()
    path = write_lock(tmp_path, socket.gethostname(), me.pid, me.create_time() - 100)
    with hold(tmp_path):
        assert json.loads(path.read_text())["process_start"] == me.create_time()


def test_a_lock_from_another_host_holds_until_untouched_for_the_stale_time(tmp_path):
    write_lock(tmp_path, "node-elsewhere", 4242, 1.0, age_s=lock.STALE_S - 60)
    with pytest.raises(UserError) as refused, hold(tmp_path):
        pass
    assert "pid 4242 on node-elsewhere" in str(refused.value)
    assert f"or delete {tmp_path / 'sweep.lock'}" in str(refused.value)

    path = write_lock(tmp_path, "node-elsewhere", 4242, 1.0, age_s=lock.STALE_S + 60)
    with hold(tmp_path):
        assert held_by(path) == os.getpid()


def test_an_unreadable_lock_left_by_a_crash_mid_write_is_taken_over(tmp_path):
    path = tmp_path / "sweep.lock"
    path.write_text("")
    os.utime(path, (time.time() - 60, time.time() - 60))
    with hold(tmp_path):
        assert held_by(path) == os.getpid()


def test_the_holder_touches_its_lock_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "BEAT_S", 0.05)
    with hold(tmp_path):
        path = tmp_path / "sweep.lock"
        os.utime(path, (1.0, 1.0))
        time.sleep(0.5)
        assert time.time() - path.stat().st_mtime < 5


def test_only_a_search_on_a_database_shares_its_folder(tmp_path):
    common = {k: v for k, v in micro_run().items() if k in ("model", "task", "train")}
    grid = write_yaml(tmp_path / "grid.yaml", {"name": "g", **common, "methods": {"full": {}}})
    search = write_yaml(tmp_path / "tpe.yaml", {
        "name": "s", **common, "methods": {"full": {}},
        "search": {"sampler": "tpe", "n_trials": 2,
                   "space": {"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}}})
    database = {"storage": "postgresql://u:p@db/h"}
    out = tmp_path / "runs"
    assert not open_search(load_sweep(grid, {}), out).shared
    assert not open_search(load_sweep(grid, database), out).shared  # a grid has no study
    assert not open_search(load_sweep(search, {}), out).shared  # its journal, in the folder
    assert open_search(load_sweep(search, database), out).shared


def test_a_second_sweep_on_one_folder_exits_2_and_the_first_finishes_alone(tmp_path):
    """Started twice on one --out, both used to run every trial: metrics lines twice, one
    trial's processes fighting over its checkpoint."""
    run = micro_run(steps=30, log_every=1)
    data = {k: run[k] for k in ("model", "task", "train")}
    data.update(name="twice", eval={"every": 0, "tokens": 64}, methods={"full": {}},
                search={"space": {"train.lr": [1e-3, 3e-3]}})
    path, out = write_yaml(tmp_path / "twice.yaml", data), tmp_path / "runs"
    first = start_sweep(path, out)
    while not list(out.glob("trials/*/metrics.jsonl")):
        assert first.poll() is None, first.communicate()
        time.sleep(0.2)
    wait_for_step(next(out.glob("trials/*/metrics.jsonl")).parent, 1)

    second = harness_here("sweep", str(path), "--out", str(out))
    assert second.returncode == 2
    (line,) = second.stderr.splitlines()
    assert line.startswith(f"error: {out} is in use by another sweep: pid {first.pid} on "
                           f"{socket.gethostname()} since ")
    assert f"(harness sweep {path} --out {out})" in line

    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stdout + stderr
    for metrics in out.glob("trials/*/metrics.jsonl"):
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()
                 if json.loads(x)["kind"] == "train"]
        assert steps == list(range(1, 31))  # each step logged once: one process trained it
    assert not (out / "sweep.lock").exists()
