"""The run folder: atomic writes, tolerant reads, Status, the Summary model and its columns."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
from conftest import micro_run

from harness.analysis.load import NUMERIC_FIELDS, SUMMARY_FIELDS
from harness.methods.resolve import load_run
from harness.trials import (
    FAILED,
    FINISHED,
    RunsDir,
    Status,
    Summary,
    TrialDir,
    atomic_write,
    read_json,
    read_jsonl,
    read_jsonl_tail,
    write_json,
)
from harness.trials import files as files_module

# The keys a trial's summary.json starts with, in their order (the old `base_summary`).
START_KEYS = [
    "trial", "status", "method", "method_name", "params", "lr", "seed", "model", "steps",
    "step", "tokens", "eval_loss", "eval_ppl", "tokens_per_s", "mfu", "peak_memory_bytes",
    "peak_rss_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes", "trainable_params",
    "wall_s", "device", "error", "requeues", "host", "started_at",
]  # fmt: skip


def test_atomic_write_replaces_the_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    atomic_write(path, "one")
    atomic_write(path, b"two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]


def test_a_crash_between_write_and_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_json(path, {"status": "running"})

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(files_module.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        write_json(path, {"status": "ok"})
    assert read_json(path) == {"status": "running"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_write_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(files_module.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    atomic_write(tmp_path / "a.json", "{}")
    assert len(synced) == 2  # the temp file before the rename, the folder after


def test_metrics_lines_are_fsynced_as_appended(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(files_module.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    files_module.append_jsonl(tmp_path / "metrics.jsonl", {"step": 1})
    files_module.append_jsonl(tmp_path / "metrics.jsonl", {"step": 2})
    assert len(synced) == 2 and read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1},
                                                                            {"step": 2}]


def test_reads_take_a_half_written_file_as_absent(tmp_path):
    path = tmp_path / "summary.json"
    assert read_json(path) is None
    path.write_text('{"status": "ru')
    assert read_json(path) is None
    path.write_text("[1, 2]")
    assert read_json(path) is None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_jsonl(metrics) == [{"step": 1}, {"step": 2}]
    assert read_jsonl_tail(metrics) == [{"step": 1}, {"step": 2}]  # read whole: none cut
    assert read_jsonl_tail(metrics, nbytes=20) == [{"step": 2}]  # began mid-line: dropped
    assert read_jsonl_tail(tmp_path / "missing.jsonl") == []
    trial = TrialDir(tmp_path)
    trial.config.write_text("a: [1,")
    assert trial.read_config() == {}
    # written atomically, a summary.json that is there is whole: "[1, 2]" is damaged, not absent
    assert trial.read_summary().status == "unreadable"


def test_status_is_its_string():
    assert [s.value for s in Status] == [
        "pending", "running", "interrupted", "queued", "ok", "failed", "oom", "nan", "killed",
        "pruned", "unreadable",
    ]  # fmt: skip
    assert Status.OK == "ok" and "ok" in {Status.OK} and Status("nan") is Status.NAN
    assert f"{Status.OOM}" == str(Status.OOM) == "oom"
    assert json.dumps({"status": Status.PRUNED}) == '{"status": "pruned"}'
    assert FINISHED == ("ok", "nan", "oom", "killed", "failed", "pruned", "unreadable")
    assert FAILED == ("failed", "oom", "nan", "killed", "unreadable")
    assert "failed" in FAILED and "interrupted" not in FINISHED
    assert pd.Series(["ok", "running"]).isin(FINISHED).tolist() == [True, False]


def test_summary_starts_with_the_fields_the_tables_read(tmp_path):
    run = load_run(micro_run())
    start = Summary.start(run, "t1", requeues=2).to_dict()
    assert list(start) == START_KEYS
    assert start["status"] == "running" and type(start["status"]) is str
    assert start["trial"] == "t1" and start["requeues"] == 2 and start["method"] == "full"
    assert start["step"] == 0 and start["eval_ppl"] is None


def test_summary_round_trip_keeps_keys_order_and_extras(tmp_path):
    trial = TrialDir(tmp_path / "t1")
    data = {"trial": "t1", "status": "ok", "build_s": 1.5, "total_params": 10,
            "eval_ppl": 12.5, "params": {"rank": 4}, "tokens": 128}
    trial.path.mkdir()
    write_json(trial.summary, data)
    before = trial.summary.read_bytes()
    summary = trial.read_summary()
    assert summary.status == Status.OK and summary.eval_ppl == 12.5
    assert summary.get("build_s") == 1.5 and summary.get("requeues", 0) == 0
    assert summary.to_dict() == data and list(summary.to_dict()) == list(data)
    trial.write_summary(summary)
    assert trial.summary.read_bytes() == before
    trial.count_requeue()
    assert list(read_json(trial.summary)) == [*data, "requeues"]
    assert read_json(trial.summary)["requeues"] == 1


def test_an_odd_summary_is_read_as_it_is(tmp_path):
    summary = Summary.parse({"status": "someday", "steps": "many", "x": 1})
    assert summary.status == "someday" and summary.get("x") == 1
    assert summary.to_dict() == {"status": "someday", "steps": "many", "x": 1}


def test_mark_end_only_an_unfinished_trial(tmp_path):
    trial = TrialDir(tmp_path / "t1")
    trial.mark_end(Status.FAILED, "cancelled")
    assert read_json(trial.summary) == {"trial": "t1", "status": "failed", "error": "cancelled"}
    write_json(trial.summary, {"trial": "t1", "status": "running", "pid": 1})
    trial.record_crash(-9)
    assert read_json(trial.summary) == {
        "trial": "t1", "status": "failed", "pid": 1, "error": "trial process ended with signal 9"
    }  # fmt: skip
    write_json(trial.summary, {"status": "ok"})
    trial.record_crash(1)
    trial.mark_end(Status.FAILED, "late")
    assert read_json(trial.summary) == {"status": "ok"}


def test_launch_record_and_runs_folder(tmp_path):
    runs = RunsDir(tmp_path)
    assert runs.trial_dirs() == [] and not runs.is_runs_dir()
    for name in ("t10", "t2", "t1"):
        runs.trial(name).record_launch("slurm", "12_3")
    assert [t.name for t in runs.trial_dirs()] == ["t1", "t2", "t10"]
    launch = runs.trial("t2").read_launch()
    assert launch["launcher"] == "slurm" and launch["job_id"] == "12_3"
    assert runs.trial("t9").read_launch() == {}
    assert TrialDir(runs.trial("t1")) == runs.trial("t1")
    assert os.fspath(runs.trial("t1")) == str(tmp_path / "trials" / "t1")
    runs.write_sweep({"name": "s"})
    assert runs.read_sweep() == {"name": "s"} and RunsDir(tmp_path / "x").read_sweep() == {}


def test_analysis_columns_are_the_models_fields():
    assert Summary.columns() == SUMMARY_FIELDS
    assert set(NUMERIC_FIELDS) <= set(SUMMARY_FIELDS)
    assert {"params", "host", "started_at", "pid"}.isdisjoint(SUMMARY_FIELDS)
    assert set(START_KEYS) - {"params", "host", "started_at"} <= set(SUMMARY_FIELDS)
