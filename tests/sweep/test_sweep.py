"""A sweep through the real command: resume, skip finished, NaN continues, status, report."""

from __future__ import annotations

import json

from conftest import harness, harness_here, micro_run, write_yaml

from harness.methods.resolve import load_run
from harness.sweep.plan.expand import expand, load_sweep
from harness.train import train


def sweep_file(tmp_path):
    run = micro_run(steps=4)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data.update(
        name="mini",
        methods={"full": {"space": {"train.lr": [0.003, 1e30]}}, "adam8bit": {}},
        search={"space": {"train.lr": [0.003]}},
    )
    return write_yaml(tmp_path / "mini.yaml", data)


def statuses(out) -> dict[str, str]:
    return {
        d.name: json.loads((d / "summary.json").read_text())["status"]
        for d in sorted((out / "trials").iterdir())
    }


def test_sweep_resumes_skips_finished_and_survives_a_nan_trial(tmp_path):
    path, out = sweep_file(tmp_path), tmp_path / "runs"
    trials = {(t.label, t.run.train.lr): t for t in expand(load_sweep(path, {}))}
    assert len(trials) == 3
    # A trial stopped at step 2 (as by Ctrl-C) before the sweep runs.
    stopped = trials[("adam8bit", 0.003)]
    first = train(stopped.run, out / "trials" / stopped.id, should_stop=lambda step: step == 2)
    assert first["status"] == "interrupted"

    done = harness("sweep", str(path), "--out", str(out), "--jobs", "2")
    assert done.returncode == 1, done.stderr  # one trial ended nan: the sweep finishes, exit 1
    assert f"[{stopped.id}] resumed from" in done.stdout
    assert statuses(out) == {
        trials[("adam8bit", 0.003)].id: "ok",
        trials[("full", 0.003)].id: "ok",
        trials[("full", 1e30)].id: "nan",
    }
    steps = [
        r["step"]
        for r in map(
            json.loads, (out / "trials" / stopped.id / "metrics.jsonl").read_text().splitlines()
        )
        if r["kind"] == "train"
    ]
    assert steps == [1, 2, 3, 4]

    ok = out / "trials" / trials[("full", 0.003)].id / "summary.json"
    stamp = ok.stat().st_mtime_ns
    again = harness_here("sweep", str(path), "--out", str(out))
    assert "3 trials, 3 already finished, 0 to run" in again.stdout
    assert ok.stat().st_mtime_ns == stamp

    status = harness_here("status", str(out))
    assert status.returncode == 0
    assert all(t.id in status.stdout for t in trials.values()) and "nan" in status.stdout
    watched = harness_here("status", str(out), "--watch", "1")  # all finished: one frame, then exit
    assert watched.returncode == 0 and watched.stdout.count("\033[2J") == 1
    assert all(t.id in watched.stdout for t in trials.values())

    report = harness_here("report", str(out))
    assert report.returncode == 0, report.stderr
    summary_md = (out / "report" / "report.md").read_text()
    assert "full" in summary_md and "adam8bit" in summary_md
    assert "Best LR per method: full 0.003, adam8bit 0.003" in summary_md
    assert (out / "report" / "loss.png").stat().st_size > 10_000
    assert len((out / "report" / "trials.csv").read_text().splitlines()) == 4


def test_retry_failed_runs_the_nan_trial_again(tmp_path):
    data = {
        "name": "one",
        **{
            k: v
            for k, v in micro_run(steps=2, lr=1e30).items()
            if k in ("model", "task", "train", "eval")
        },
        "methods": {"full": {}},
    }
    path, out = write_yaml(tmp_path / "one.yaml", data), tmp_path / "runs"
    first = harness_here("sweep", str(path), "--out", str(out))
    assert first.returncode == 1
    retry = f"1 trials failed; run them again: harness sweep {path} --out {out} --retry-failed"
    assert first.stderr.splitlines()[-1] == retry
    # Run again as it was: nothing runs, and it says why and how to run the failed trial
    plain = harness_here("sweep", str(path), "--out", str(out))
    assert plain.returncode == 1
    assert (f"1 trials, 1 already finished, 0 to run in {out}; 1 of them failed (run them "
            "again with --retry-failed)") in plain.stdout
    assert plain.stderr.splitlines()[-1] == retry
    rerun = harness_here("sweep", str(path), "--out", str(out), "--retry-failed")
    assert "1 trials, 0 already finished, 1 to run" in rerun.stdout


def test_trial_config_round_trips_through_harness_train(tmp_path):
    trial = expand(load_sweep(sweep_file(tmp_path), {}))[0]
    config = write_yaml(tmp_path / "config.yaml", trial.run.model_dump())
    from harness.config import read_yaml

    assert load_run(read_yaml(config)).identity() == trial.run.identity()
