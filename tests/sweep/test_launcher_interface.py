"""The launcher interface (harness/sweep/launchers/): every kind has its config, launcher and
cluster; a scheduler's names stay in its launcher's files; a trial stops with a checkpoint
on whatever signal its launcher names for a requeue."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from conftest import micro_run

from harness.config import SweepConfig, validate
from harness.config.launchers import KINDS
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.sweep.launchers import CLUSTERS, Cluster, requeue_signals
from harness.sweep.launchers.launch import LAUNCHERS
from harness.train import train
from harness.trials import TrialDir

REPO = Path(__file__).resolve().parents[2]
# A scheduler's names: its variables (SLURM_*), commands (squeue) and library (submitit).
SCHEDULER = re.compile(r"slurm|squeue|submitit", re.IGNORECASE)
OWN = {  # the Slurm launcher's own files, and its config's
    "harness/sweep/launchers/slurm.py", "harness/sweep/launchers/slurm_job.py",
    "harness/sweep/launchers/slurm_cluster.py", "harness/config/launchers/slurm.py",
}
# The registries list every launcher: there a name may appear only where it is imported or
# listed.
REGISTRIES = {"harness/config/launchers/__init__.py", "harness/sweep/launchers/__init__.py",
              "harness/sweep/launchers/launch.py"}


def sweep(**data) -> SweepConfig:
    return validate(SweepConfig, {"name": "s", "methods": {"full": {}}, **data})


def test_only_a_launchers_own_files_name_its_scheduler():
    found = []
    for root in ("harness", "methods", "analysis"):
        for path in sorted((REPO / root).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name in OWN:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                listed = name in REGISTRIES and re.match(r"(from |import |CONFIGS\b)", line)
                if SCHEDULER.search(line) and not listed:
                    found.append(f"{name}:{number}: {line.strip()}")
    assert found == []


def test_every_kind_has_its_config_its_launcher_and_a_cluster():
    assert set(LAUNCHERS) == set(KINDS)
    for kind, launcher in LAUNCHERS.items():
        assert kind in launcher.kinds and kind in KINDS[kind].kinds()
        assert issubclass(launcher.cluster, Cluster)
    assert set(CLUSTERS) <= set(KINDS)  # a cluster answers for jobs of a launcher's kind


def test_a_launcher_takes_its_own_keys_and_names_the_kind_that_has_another():
    assert sweep(launcher={"kind": "slurm", "partition": "gpu"}).launcher.partition == "gpu"
    assert sweep(launcher={"jobs": 2}).launcher.kind == "local"  # no kind: local
    with pytest.raises(UserError, match=r"^unknown key 'launcher.partition' \('partition' is a "
                                        r"key of kind submitit-local and slurm; allowed: kind, "
                                        r"jobs, profile, nodes, tasks_per_node, max_requeues\)$"):
        sweep(launcher={"partition": "gpu"})
    with pytest.raises(UserError, match=r"^unknown key 'launcher.partiton' \(did you mean "
                                        r"'partition', a key of kind submitit-local and slurm\? "
                                        r"allowed: kind, jobs,"):
        sweep(launcher={"kind": "local", "partiton": "gpu"})
    with pytest.raises(UserError, match=r"^launcher.kind: 'pbs' is not allowed \(allowed: "
                                        r"'local', 'submitit-local'"):
        sweep(launcher={"kind": "pbs"})


def test_a_trial_stops_with_a_checkpoint_on_the_signal_its_launcher_names(tmp_path,
                                                                            monkeypatch):
    """A cluster whose requeue signal is SIGUSR1: `harness train` hands the trial every
    cluster's (`requeue_signals`), and that one ends the step with a checkpoint."""

    class Usr1(Cluster):
        kinds = ("usr1",)
        requeue_signal = signal.SIGUSR1

    monkeypatch.setitem(CLUSTERS, "usr1", Usr1)
    assert set(requeue_signals()) == {signal.SIGUSR1, signal.SIGUSR2}
    uncaught: list[int] = []  # this test's process outlives a trial that does not catch it
    guard = signal.signal(signal.SIGUSR1, lambda signum, _: uncaught.append(signum))

    def signal_at_step_2(step: int) -> bool:
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return False

    try:
        summary = train(load_run(micro_run(steps=6)), tmp_path / "t",
                        should_stop=signal_at_step_2, requeue=requeue_signals())
    finally:
        signal.signal(signal.SIGUSR1, guard)
    assert (summary["status"], summary["step"], uncaught) == ("interrupted", 3, [])
    assert TrialDir(tmp_path / "t").checkpoint.is_file()


def test_a_jobs_ports_are_below_the_ephemeral_range_and_alike_on_every_task():
    """Rank 0's port and the Optuna board's, from the job's id: the same on every task, and
    below Linux's ephemeral range (32768-60999), which no client connection's own end takes."""
    from harness.sweep.launchers.base import Ranks, job_port

    ports = [Ranks.port(str(job)) for job in range(5000)]
    assert all(20000 <= p < 32768 for p in ports) and len(set(ports)) > 4000
    assert Ranks.port("4242_7") == job_port("4242_7") == Ranks.port("4242_7")
    assert job_port("4242_7/board") != job_port("4242_7")
