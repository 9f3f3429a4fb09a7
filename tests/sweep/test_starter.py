"""A trial forked from the warm fork server is the `harness train` a fresh interpreter runs:
the same losses, its own threads, stdout and stderr, exit status and working directory."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from conftest import micro_run, write_yaml
from conftest import train_losses as losses

from harness.sweep.run.process import trial_command, trial_env
from harness.sweep.run.starter import PRELOAD, start_trial
from harness.trials import TrialDir, read_json


def forked(trial_dir, threads: int = 1) -> tuple[int, list[str]]:
    with TrialDir(trial_dir).open_stderr() as stderr:
        trial = start_trial(trial_dir, trial_env(threads), stderr)
        lines = [line.rstrip() for line in trial.stdout]
        return trial.wait(), lines


def untimed(lines: list[str]) -> list[str]:
    return [re.sub(r"tok/s [\d,]+", "tok/s N", line) for line in lines]


def test_a_forked_trial_trains_as_a_fresh_process_does(tmp_path):
    config = micro_run(steps=3)
    write_yaml(tmp_path / "fresh" / "config.yaml", config)
    write_yaml(tmp_path / "forked" / "config.yaml", config)
    fresh = subprocess.run(trial_command(tmp_path / "fresh"), env=trial_env(1),
                           capture_output=True, text=True, timeout=300)
    code, lines = forked(tmp_path / "forked")
    assert (fresh.returncode, code) == (0, 0)
    assert losses(tmp_path / "forked") == losses(tmp_path / "fresh")  # bit for bit
    assert untimed(lines) == untimed(fresh.stdout.replace("fresh: ok", "forked: ok").splitlines())
    # the fork server's torch sized its pool by the 2 cores; the trial asked for 1
    assert read_json(tmp_path / "forked" / "summary.json")["threads"] == 1


def test_a_forked_trial_runs_in_the_callers_folder_and_logs_its_stderr(tmp_path, monkeypatch):
    """The fork server started before the caller changed folder: a relative trial folder is
    still found, and a user error's one line lands in the trial's stderr log."""
    forked(write_yaml(tmp_path / "warm" / "config.yaml", micro_run(steps=1)).parent)
    monkeypatch.chdir(tmp_path)
    write_yaml(tmp_path / "trial" / "config.yaml", {**micro_run(steps=1), "model": "llama_nine"})
    code, _ = forked(TrialDir("trial").path)
    assert code == 2  # the CLI's exit status for a user error
    log = (tmp_path / "trial" / "stderr.log").read_text().strip().splitlines()
    assert len(log) == 1 and "llama_nine" in log[0], log


def test_the_fork_server_never_touches_cuda(tmp_path):
    """A forked child cannot use CUDA if its parent initialised it: the server's imports must
    not ask torch.cuda anything (on a CPU machine the calls are caught, not made)."""
    probe = (
        "import importlib, torch\n"
        "calls = []\n"
        "def refuse(name):\n"
        "    def call(*a, **k):\n"
        "        calls.append(name)\n"
        "        return False\n"
        "    return call\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'is_initialized',\n"
        "             'current_device', 'get_device_capability', 'get_device_properties'):\n"
        "    setattr(torch.cuda, name, refuse(name))\n"
        f"for module in {PRELOAD!r}:\n"
        "    importlib.import_module(module)\n"
        "print(calls)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_signal_to_a_trial_that_ended_unread_is_nothing(tmp_path):
    """The fork server reaps a child before its exit status reaches us: in that window the
    trial reads as running but its pid is gone, and a signal to it (the launcher stopping
    trials, a rank's peers stopped) does nothing, as `subprocess.Popen.send_signal` does."""
    trial_dir = write_yaml(tmp_path / "t" / "config.yaml", micro_run(steps=1)).parent
    with TrialDir(trial_dir).open_stderr() as stderr:
        trial = start_trial(trial_dir, trial_env(1), stderr)
        trial.stdout.read()
        assert trial.wait() == 0
    trial.process._popen.returncode = None  # the status not read yet; the pid already reaped
    trial.process._popen.poll = lambda flag=os.WNOHANG: None
    trial.send_signal(signal.SIGTERM)
    trial.kill()
