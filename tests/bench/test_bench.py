"""`harness bench loop` measures both loops and reports a ratio with its target."""

from __future__ import annotations

import json

import pytest

from harness.cli import main


def test_bench_loop_json_record(capfd):
    argv = [
        "bench",
        "loop",
        "--model",
        "llama_micro",
        "--steps",
        "4",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--rounds",
        "2",
        "--json",
    ]
    assert main(argv) == 0
    records = json.loads(capfd.readouterr().out)  # the whole stdout: JSON alone
    (record,) = records
    assert record["name"] == "loop/llama_micro/32-true/cpu" and record["target"] == 0.98
    assert len(record["rounds"]) == 2
    for r in record["rounds"]:
        assert r["harness_tok_s"] > 0 and r["bare_tok_s"] > 0
        assert abs(r["ratio"] - r["harness_tok_s"] / r["bare_tok_s"]) < 1e-9
    assert 0.2 < record["ratio"] < 5


def test_bench_optim_records_and_table_from_the_command(capfd):
    from harness.bench.loop import optim_table

    argv = ["bench", "optim", "--preset", "llama_micro", "--gap", "4", "--steps", "2", "--rank",
            "8", "--threads", "1", "--e2e", "8:2", "--json"]
    assert main(argv) == 0
    out = optim_table(json.loads(capfd.readouterr().out))
    for name in ("adamw", "galore", "galore_rsvd", "galore_torch",
                 "e2e_galore/llama_tiny/rank8/1024tok"):
        assert name in out
    assert "vs galore-torch" in out and "0.8" in out and "1.05" in out


def test_bench_memory_estimates_every_method_exactly(capfd):
    """Weights, gradients, optimizer states and extras after three steps equal the estimator's
    prediction for every method (8-bit layer-wise GaLore included); each method also gets a
    peak record with its ±5% tolerance."""
    argv = ["bench", "memory", "--preset", "llama_micro", "--steps", "3", "--seq-len", "32",
            "--batch-size", "2", "--json"]
    assert main(argv) == 0
    records = json.loads(capfd.readouterr().out)  # the whole stdout: JSON alone
    parts = [r for r in records if "tolerance" not in r]
    assert len(parts) == 14 * 4
    assert all(r["value"] == r["estimate"] and r["ratio"] == 1.0 for r in parts), [
        r for r in parts if r["value"] != r["estimate"]]
    layerwise = {r["name"]: r["value"] for r in parts if "galore_8bit_layerwise" in r["name"]}
    full = {r["name"]: r["value"] for r in parts if "/galore/" in r["name"]}
    assert layerwise["memory/llama_micro/galore_8bit_layerwise/grad_bytes"] < full[
        "memory/llama_micro/galore/grad_bytes"]
    peaks = {r["name"].split("/")[2]: r for r in records if r.get("tolerance") == 0.05}
    assert len(peaks) == 14 and all(r["value"] > 0 and r["estimate"] > 0 for r in peaks.values())
    assert abs(peaks["full"]["ratio"] - 1) <= 0.05


def test_bench_memory_refuses_fewer_than_three_steps(capsys):
    assert main(["bench", "memory", "--preset", "llama_micro", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --steps 2:") and "--steps 3 or more" in err


def test_bench_launch_times_each_launcher(capfd):
    """One trial per launcher: a positive overhead, launch to first step minus the build."""
    assert main(["bench", "launch", "--rounds", "1", "--json"]) == 0
    records = json.loads(capfd.readouterr().out)  # the whole stdout: JSON alone
    assert [r["name"] for r in records] == ["launch/local", "launch/submitit-local"]
    for r in records:
        assert len(r["per_trial"]) == 1 and 0 < r["value"] < 120 and r["unit"] == "s"


def test_bench_e2e_setting_is_checked(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "optim", "--e2e", "64"])
    assert stop.value.code == 2
    assert "expected RANK:MICRO" in capsys.readouterr().err


def test_training_step_reads_no_device_value():
    """No `.item()`, `float(t)` or `bool(t)` in a steady training step (each is a host sync on
    a GPU), fp16 included; GradScaler's own check is seen where the optimizer is not fused."""
    from harness.bench.memory import method_run
    from harness.bench.syncs import count_reads, syncs_table

    records = []
    for label, overrides, expected in [("full", None, set()),
                                       ("full", {"train.precision": "fp16"}, set()),
                                       ("galore", {"train.precision": "fp16"}, {"precision.py"})]:
        sites, cuda = count_reads(method_run(label, "llama_micro", 4, 32, 2, overrides), 2)
        assert {s.split(":")[0].split("/")[-1] for s in sites} == expected, sites
        assert sum(sites.values()) == 2 * len(expected) and cuda == 0
        records.append({"name": label, "value": sum(sites.values()) / 2, "target": len(expected),
                        "sites": dict(sites), "cuda_syncs_per_step": 0.0})
    assert "modifiers/precision.py" in syncs_table(records)


def test_train_profile_writes_trace_and_operator_table(tmp_path, capsys):
    from conftest import micro_run, write_yaml

    config = write_yaml(tmp_path / "run.yaml", micro_run(steps=4))
    assert main(["train", str(config), "--out", str(tmp_path / "t"), "--profile", "3"]) == 2
    assert "--profile 3: the run has 4 steps and the profile needs 5" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()  # refused before anything was written
    assert main(["train", str(config), "--out", str(tmp_path / "t"), "--profile", "2"]) == 0
    trace = json.loads((tmp_path / "t" / "profile" / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # steps 3 and 4 of the run
    ops = (tmp_path / "t" / "profile" / "ops.txt").read_text()
    assert "aten::mm" in ops and "Self CPU" in ops
