"""Checks before work starts (issue 65): a CUDA device asked for where none is visible, a run
folder under a file, and one on a disk this process cannot write are refused in one line by
`harness train` and `harness sweep`, before a trial starts or a run folder is written; a
launcher that cannot run on this machine before the sweep reads its data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import micro_run, write_yaml
from ports import free_port

from harness.cli import main
from harness.config import SweepConfig, validate
from harness.errors import UserError
from harness.sweep.launchers.launch import check_launcher
from harness.sweep.plan.expand import expand, preflight
from harness.sweep.plan.forecast import check_disk


def sweep_data(**top) -> dict:
    run = micro_run(steps=1)
    return {"name": "pre", "model": "llama_micro", "task": run["task"], "train": run["train"],
            "eval": run["eval"], "methods": {"full": {}}, **top}


@pytest.fixture
def files(tmp_path):
    """A run config and a sweep file, and a plain file to put run folders under."""
    (tmp_path / "notes.txt").write_text("a file")
    return (write_yaml(tmp_path / "run.yaml", micro_run(steps=1)),
            write_yaml(tmp_path / "sweep.yaml", sweep_data()))


@pytest.fixture
def read_only(tmp_path):
    """A folder this process cannot write in, and the cause the refusal names: a read-only
    tmpfs as root (root writes through any mode bits; CI runs as root), else a 0555 folder."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder, "may not write in"
        folder.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    yield folder, "is on a read-only file system"
    subprocess.run(["umount", "-l", str(folder)], check=False)


def refused(capsys, argv: list[str]) -> str:
    """The one line `harness ARGV` exits 2 with."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_cuda_asked_for_where_none_is_visible_is_refused_before_a_trial(
        tmp_path, files, capsys, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = files[0] if command == "train" else files[1]
    err = refused(capsys, [command, str(config), "--set", "device=cuda",
                           "--out", str(tmp_path / "out")])
    assert err == ("error: device: 'cuda' asked for but no CUDA device is visible "
                   "(allowed: auto, cpu)")
    assert not (tmp_path / "out").exists()  # no trial folder, no failed summary


def test_a_slurm_sweeps_device_is_its_nodes_not_this_machines(tmp_path, monkeypatch):
    """The submitting machine may have no GPU: only trials that run here are checked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    local = validate(SweepConfig, sweep_data(device="cuda"))
    with pytest.raises(UserError, match="no CUDA device is visible"):
        preflight(local, tmp_path / "out")
    slurm = validate(SweepConfig, sweep_data(device="cuda", launcher={"kind": "slurm"}))
    preflight(slurm, tmp_path / "out")


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_run_folder_under_a_file_is_one_line(tmp_path, files, capsys, command):
    config = files[0] if command == "train" else files[1]
    out = tmp_path / "notes.txt" / "runs"
    err = refused(capsys, [command, str(config), "--out", str(out)])
    assert err == (f"error: --out {out}: {tmp_path / 'notes.txt'} is a file, not a folder; "
                   "give a path whose every part above the run folder is a folder")
    assert (tmp_path / "notes.txt").read_text() == "a file"


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_run_folder_on_a_disk_this_process_cannot_write_names_that_cause(
        files, read_only, capsys, command):
    folder, cause = read_only
    config = files[0] if command == "train" else files[1]
    err = refused(capsys, [command, str(config), "--out", str(folder / "runs")])
    assert err.startswith(f"error: --out {folder / 'runs'}: cannot write the run folder there "
                          f"({folder} ") and cause in err and "free" not in err
    assert list(folder.iterdir()) == []


def test_the_disk_check_names_an_unwritable_folder_not_its_free_bytes(read_only):
    folder, cause = read_only
    sweep = validate(SweepConfig, sweep_data())
    with pytest.raises(UserError, match=cause) as refusal:
        check_disk(sweep.launcher, expand(sweep), folder / "runs")
    assert "free" not in str(refusal.value)


def test_slurm_without_its_commands_is_one_line_before_the_data_is_read(tmp_path, files, capsys,
                                                                         monkeypatch):
    """No sbatch or srun on PATH: one line naming them and submitit-local, before the data is
    opened (a missing corpus would be the error otherwise) and before the run folder or a trial
    folder is written (submitit's own error came as a traceback after both)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "runs"
    err = refused(capsys, ["sweep", str(files[1]), "--out", str(out),
                           "--set", "launcher.kind=slurm",
                           "--set", f"task.dataset={tmp_path / 'no_corpus'}"])
    assert err == ("error: launcher.kind slurm needs Slurm's sbatch and srun on PATH (this "
                   "machine has none); use launcher.kind submitit-local to run the same jobs "
                   "here, or run the sweep on a Slurm login node")
    assert not out.exists()
    local = validate(SweepConfig, sweep_data(launcher={"kind": "submitit-local"})).launcher
    check_launcher(local)  # the same jobs on this machine need no Slurm command


def test_ray_missing_or_unanswered_is_refused_by_the_launchers_check(monkeypatch):
    """The Ray launcher's check, which the sweep makes before its preflight: Ray not installed
    (its import fails), or nothing listening at the cluster's address."""
    address = f"127.0.0.1:{free_port()}"
    ray = validate(SweepConfig, sweep_data(launcher={"kind": "ray", "address": address}))
    with pytest.raises(UserError, match=f"^launcher.address {address}: no Ray cluster answers"):
        check_launcher(ray.launcher)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(UserError) as refusal:
        check_launcher(ray.launcher)
    assert str(refusal.value) == "launcher.kind ray needs Ray: pip install 'harness[ray]'"
