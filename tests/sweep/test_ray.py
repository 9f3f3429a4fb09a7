"""Sweeps on a real one-node Ray cluster (`bash scripts/ray.sh start`; CI starts it).

Each test runs `harness sweep` with `--set launcher.kind=ray` as a user does, the cluster's
address in RAY_ADDRESS, and checks the trial folders, the output and what Ray says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import conftest
import psutil
import pytest
import yaml
from conftest import (
    REPO,
    STEPS_LEFT,
    micro_run,
    torchrun,
    train_losses,
    wait_for_step,
    write_yaml,
)
from services import require_service

from harness.methods.resolve import load_run
from harness.sweep.run.trial_state import trial_statuses
from harness.train import train
from harness.trials import checkpoints, read_json

RAY = ("launcher.kind=ray",)
start_sweep = partial(conftest.start_sweep, stderr=subprocess.STDOUT)  # one stream, in order


@pytest.fixture(autouse=True)
def cluster(monkeypatch) -> str:
    address = require_service("HARNESS_RAY_ADDRESS", "the one-node Ray cluster",
                              "bash scripts/ray.sh start")
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's addresses on loopback
    return address


def sweep_file(tmp_path: Path, steps: int, lrs: list[float], **train_keys) -> Path:
    run = micro_run(**{"steps": steps, "log_every": 1, **train_keys})
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 128}
    data.update(name="ray", methods={"full": {}}, search={"space": {"train.lr": lrs}})
    return write_yaml(tmp_path / "ray.yaml", data)


def finish(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    return out


def trial_dirs(out: Path, count: int) -> list[Path]:
    """The sweep's `count` trial folders once each has recorded its launch."""
    deadline = time.time() + 120
    while len(found := sorted((out / "trials").glob("*/launch.json"))) < count:
        assert time.time() < deadline, f"{len(found)} of {count} trials launched"
        time.sleep(0.2)
    return [p.parent for p in found]


def ppls(out: Path) -> dict[str, float]:
    return {d.name: read_json(d / "summary.json")["eval_ppl"] for d in (out / "trials").iterdir()}


def on_two_cpus() -> None:
    """The local sweep's CPUs: 2, so that its 2 trials at once get a thread each, as each of
    the Ray trials' tasks does (`cpus_per_task` 1)."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def test_the_quickstart_through_ray_gives_the_local_perplexities(tmp_path):
    """Three of the quickstart's entries (AdamW, LoRA and 8-bit layer-wise GaLore), as they are
    in sweeps/quickstart.yaml but at the first learning rate of each one's grid (another rate
    runs the same code: three trials, two at once) and for 6 of its 30 steps, an eval at the
    3rd (more steps run the same code), run locally and on Ray: each trial's process has one
    thread either way, so the eval perplexities are equal."""
    data = yaml.safe_load((REPO / "sweeps" / "quickstart.yaml").read_text())
    data["methods"] = {k: data["methods"][k] for k in ("full", "lora", "galore_8bit_layerwise")}
    data["train"]["steps"], data["eval"]["every"] = 6, 3
    for entry in (data, *data["methods"].values()):  # the sweep's grid and an entry's own
        space = (entry.get("search") or entry).get("space")
        if space:
            space["train.lr"] = space["train.lr"][:1]
    path = write_yaml(tmp_path / "quickstart.yaml", data)
    times = {}
    for kind in ("local", "ray"):
        start = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", "sweep", str(path), "--out",
             str(tmp_path / kind), "--set", f"launcher.kind={kind}"], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=on_two_cpus)
        log = finish(proc)
        times[kind] = time.time() - start
        assert proc.returncode == 0 and "3 ok" in log, log
    local, ray = ppls(tmp_path / "local"), ppls(tmp_path / "ray")
    assert len(local) == 3 and ray == local
    threads = {read_json(d / "summary.json")["threads"] for kind in ("local", "ray")
               for d in (tmp_path / kind / "trials").iterdir()}
    assert threads == {1}
    launches = {read_json(d / "launch.json")["launcher"] for d in (tmp_path / "ray" / "trials")
                .iterdir()}
    assert launches == {"ray"}
    print(f"3 quickstart trials: local {times['local']:.1f} s, ray {times['ray']:.1f} s")


def worker_of(trial_pid: int) -> psutil.Process:
    """The Ray worker running a trial: its process is forked by a fork server the worker
    started."""
    worker = psutil.Process(trial_pid).parent().parent()
    assert worker.cmdline()[0].startswith("ray::"), worker.cmdline()
    return worker


def test_a_trial_whose_ray_worker_is_killed_resumes_from_its_checkpoint(tmp_path):
    """SIGKILL to the trial's Ray worker (as its node's loss or Ray's OOM killer ends it) ends
    the trial process with it; the sweep records the trial interrupted, resubmits it, and it
    resumes from its newest checkpoint to the losses of an uninterrupted run."""
    steps = 5 + STEPS_LEFT
    reference = train(load_run(micro_run(steps=steps, log_every=1) | {
        "eval": {"every": 0, "tokens": 128}}), tmp_path / "reference")
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, steps, [3e-3]), out, *RAY,
                       "train.checkpoint_every=2")
    (trial_dir,) = trial_dirs(out, 1)
    wait_for_step(trial_dir, 5)
    worker_of(read_json(trial_dir / "summary.json")["pid"]).kill()
    log = finish(proc)
    assert proc.returncode == 0, log
    summary = read_json(trial_dir / "summary.json")
    assert (summary["status"], summary["requeues"], summary["step"]) == ("ok", 1, steps)
    assert "its Ray worker died" in log and "resubmitting them" in log
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and int(resumed[0].rsplit(" ", 1)[1]) >= 4, resumed
    assert train_losses(trial_dir) == train_losses(tmp_path / "reference")
    assert summary["eval_loss"] == reference["eval_loss"]


def test_a_two_process_fsdp_trial_runs_as_two_ray_tasks_and_equals_torchrun(tmp_path):
    """tasks_per_node=2: a placement group of two tasks, each a rank of the trial given
    torch's variables; its losses equal the same trial under torchrun (2 processes, gloo, one
    thread each: the same reductions in the same order)."""
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 4, [3e-3]), out, *RAY, "launcher.tasks_per_node=2",
                       "train.parallel=fsdp")
    log = finish(proc)
    assert proc.returncode == 0, log
    (trial_dir,) = trial_dirs(out, 1)
    run = micro_run(steps=4, lr=3e-3, log_every=1, parallel="fsdp") | {
        "eval": {"every": 0, "tokens": 128}}
    config = write_yaml(tmp_path / "run.yaml", run)
    reference = torchrun(config, tmp_path / "torchrun")
    output, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, output
    assert train_losses(trial_dir) == train_losses(tmp_path / "torchrun")
    on_ray, on_torchrun = (read_json(d / "summary.json")
                           for d in (trial_dir, tmp_path / "torchrun"))
    assert on_ray["eval_loss"] == on_torchrun["eval_loss"]
    assert on_ray["param_bytes"] == on_torchrun["param_bytes"]  # rank 0: half of every row
    stderr = (trial_dir / "stderr.log").read_text()
    assert "rank 0/2: gloo" in stderr and "rank 1/2: gloo" in stderr
    assert f"[{trial_dir.name}:1] " in log  # rank 1's output came from its own task


def cluster_cpus(address: str) -> int:
    code = (f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "print(int(ray.cluster_resources()['CPU']))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def test_harness_status_shows_a_ray_trial_queued_while_another_holds_the_cpus(tmp_path,
                                                                              cluster):
    """Two trials at once, each asking for every CPU of the cluster: Ray runs one and queues
    the other, and `harness status` says so, from the tasks' states."""
    cpus = cluster_cpus(cluster)
    out = tmp_path / "runs"
    proc = start_sweep(sweep_file(tmp_path, 40, [1e-3, 3e-3]), out, *RAY, "launcher.jobs=2",
                       f"launcher.cpus_per_task={cpus}")
    dirs = trial_dirs(out, 2)
    deadline = time.time() + 120
    while sorted(statuses := trial_statuses(dirs)) != ["queued", "running"]:
        assert time.time() < deadline, statuses
        time.sleep(0.5)
    table = conftest.harness("status", str(out)).stdout
    assert "| queued " in table and "| running " in table, table
    job = read_json(dirs[0] / "launch.json")["job_id"]
    assert job.endswith(f"@{cluster}")
    log = finish(proc)
    assert proc.returncode == 0, log
    assert trial_statuses(dirs) == ["ok", "ok"]
    assert {read_json(d / "summary.json")["threads"] for d in dirs} == {cpus}


def test_a_stop_signal_makes_running_ray_trials_checkpoint(tmp_path):
    """SIGTERM to the sweep reaches each running trial on the cluster: it saves a checkpoint,
    verified whole at the step it stopped at, and ends interrupted; the sweep exits 130. (Run
    again, a sweep resumes such folders: tests/sweep/test_faults.py; a trial resumes from its
    checkpoint on Ray: test_a_trial_whose_ray_worker_is_killed_resumes_from_its_checkpoint.)"""
    out = tmp_path / "runs"
    path = sweep_file(tmp_path, 5 + STEPS_LEFT, [1e-3, 3e-3])
    proc = start_sweep(path, out, *RAY, "launcher.jobs=2")
    dirs = trial_dirs(out, 2)
    for trial_dir in dirs:
        wait_for_step(trial_dir, 5)
    proc.send_signal(signal.SIGTERM)
    log = finish(proc)
    assert proc.returncode == 130, log
    assert "2 trials stopped with a checkpoint" in log
    for trial_dir in dirs:
        summary = read_json(trial_dir / "summary.json")
        assert summary["status"] == "interrupted" and 5 <= summary["step"] < 5 + STEPS_LEFT
        loaded = checkpoints.load_newest(trial_dir / "checkpoint")  # its record's checksum
        assert loaded is not None and loaded.path.name == "state.pt" and not loaded.skipped
        assert loaded.state["step"] == summary["step"]


HIDE_RAY = """import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoRay())
"""


@pytest.mark.parametrize("case", ["no ray", "no cluster"])
def test_a_missing_ray_or_cluster_is_one_line(tmp_path, case):
    """Without Ray installed (hidden from the child by a sitecustomize), or with no cluster at
    the address: one line naming what to install or start, exit 2, no trial started."""
    env = dict(os.environ)
    if case == "no ray":
        (tmp_path / "hide").mkdir()
        (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE_RAY)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "hide"),
                                                          env.get("PYTHONPATH")]))
    else:
        env["RAY_ADDRESS"] = f"127.0.0.1:{conftest.free_port()}"
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "sweep", str(sweep_file(tmp_path, 2, [1e-3])),
         "--out", str(out), "--set", "launcher.kind=ray"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    if case == "no ray":
        assert line == "error: launcher.kind ray needs Ray: pip install 'harness[ray]'"
    else:
        assert line.startswith(f"error: launcher.address {env['RAY_ADDRESS']}: no Ray cluster "
                               "answers there; start one with `ray start --head`")
    assert not out.exists()  # refused before the data is read or the run folder written
