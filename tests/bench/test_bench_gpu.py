"""`harness bench gpu`: the CUDA kit. Its --smoke form runs every part's code on the CPU at
llama_micro, so a kit that no device has run for weeks still works the day one is lent."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, harness

from harness.bench import gpu_mfu, gpu_parts, gpu_settings
from harness.bench.gpu import CAPS, load_state, run_part
from harness.bench.gpu_mfu import gemm_shapes
from harness.bench.gpu_parts import _junit
from harness.bench.gpu_report import render
from harness.bench.memory import METHODS
from harness.errors import UserError
from harness.trials import read_json, write_json

# Every part but mfu, whose smoke compiles llama_micro cold (most of the kit's CPU time):
# its code runs in process below, with each run's speed dictated.
SMOKE_PARTS = ["tests", "estimate", "table11", "loop", "llama7b"]


def test_smoke_runs_every_part_once_and_a_second_run_goes_on_with_what_is_left(tmp_path):
    out = tmp_path / "kit"
    # every smoke cap is 3 minutes: none fits in half a minute
    nothing = harness("bench", "gpu", "--out", str(out), "--smoke", "--budget-min", "0.5",
                      cwd=REPO)
    assert nothing.returncode == 3, nothing.stderr
    assert "left for the next run" in nothing.stdout
    assert read_json(out / "gpu.json")["parts"] == {}

    start = time.monotonic()
    done = harness("bench", "gpu", "--out", str(out), "--smoke", "--parts",
                   ",".join(SMOKE_PARTS), cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    smoke_s = time.monotonic() - start
    state = read_json(out / "gpu.json")
    parts = state["parts"]
    assert list(parts) == SMOKE_PARTS
    assert all(p["status"] == "ok" for p in parts.values()), {n: p.get("error") for n, p
                                                              in parts.items()}
    env = state["environment"]
    assert env["torch"] == torch.__version__.split("+")[0] or torch.__version__.startswith(
        env["torch"])
    assert env["smoke"] is True and "bench gpu" in env["command"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.md"]  # nothing else kept

    *outcomes, tests = parts["tests"]["records"]  # each test's as it ended, then pytest's sum
    assert tests["name"] == "gpu/tests" and tests["value"] > 0 and tests["failed"] == 0, tests
    assert len(outcomes) == tests["value"] + tests["skipped"]  # the plugin saw what junit saw
    assert {o["outcome"] for o in outcomes} <= {"passed", "skipped"}
    estimate = parts["estimate"]["records"]
    labels = {r["name"].split("/")[3] for r in estimate}  # the smoke's three (every one: below)
    assert labels == {"full", "qgalore", "apollo_mini_int8_layerwise"}
    assert len(estimate) == 3 * 5  # 4 counted parts and the peak, each method
    assert all(r["value"] == r["estimate"] for r in estimate if "tolerance" not in r)
    table11 = {r["name"].rsplit("/", 1)[1]: r for r in parts["table11"]["records"]}
    assert table11["galore_8bit_layerwise"]["paper_gb"] == 5.63  # GaLore Table 11, by hand
    assert table11["full"]["paper_tokens_per_s"] == 1256.98
    assert table11.keys() == {"full", "galore_8bit_layerwise"}
    (loop,) = parts["loop"]["records"]
    assert len(loop["rounds"]) == 1 and loop["value"] == loop["rounds"][0]["ratio"]
    big = {r["name"].rsplit("/", 1)[1]: r["paper_gb"] for r in parts["llama7b"]["records"]}
    assert big == {"galore_8bit_layerwise": 22.0, "qgalore": 15.08,
                   "apollo_mini_int8_layerwise": 12.0}
    page = (out / "gpu.md").read_text()
    assert page.count("Not run yet") == 1 and page.count("\n## ") == 6  # mfu's, not yet run
    assert "| llama_micro/full/param_bytes | 4,596,992 | 4,596,992 |" in page
    print(f"smoke run: {smoke_s:.0f} s")

    # the part left (mfu) runs, cut off at a 3-second cap; the five done are not run again
    again = harness("bench", "gpu", "--out", str(out), "--smoke", "--cap-min", "0.05",
                    cwd=REPO)
    assert again.returncode == 0 and again.stdout.count("done before (ok)") == 5, again.stdout
    assert "mfu: timeout" in again.stdout
    state = read_json(out / "gpu.json")
    assert {n: p for n, p in state["parts"].items() if n != "mfu"} == parts  # none twice
    assert state["parts"]["mfu"]["status"] == "timeout"
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.md"]
    page = (out / "gpu.md").read_text()
    assert "Not run yet" not in page and page.count("\n## ") == 6


def dictated(speeds: dict[str, float], runs: list[Any]) -> Callable[[Any], dict[str, Any]]:
    """gpu_mfu's `measured`: each run trained here (but a compiled one: inductor's cold build
    is tests/train/test_compile.py's), its status and peak kept, its tok/s the next of `speeds`
    (a CPU's would be noise, so which lever helps is known); the runs kept in `runs`."""
    order = iter(speeds.values())

    def measure(run: Any) -> dict[str, Any]:
        runs.append(run)
        record = ({"status": "ok", "peak_bytes": 0, "mfu": None} if run.train.compile
                  else gpu_settings.measured(run))
        return {**record, "tokens_per_s": next(order)}

    return measure


def test_the_mfu_part_times_each_lever_then_the_ones_that_helped_together(monkeypatch,
                                                                           tmp_path):
    """The kit's mfu part on the CPU at the smoke's sizes, in process: the GEMM probe, the
    baseline, each lever alone (liger refused), the helpful ones together at the paper's MLP
    width and padded, each method with them, 32-true with and without TF32. Speeds dictated:
    multi_tensor and compile help, loss_chunk does not, the padded MLP is never chosen."""
    speeds = {"full/baseline": 1000.0, "full/multi_tensor": 1100.0, "full/compile": 1500.0,
              "full/loss_chunk": 990.0, "full/mlp_64": 1200.0, "full/best": 1600.0,
              "full/best_padded": 1800.0, "galore/best": 800.0, "adam8bit/best": 1700.0,
              "apollo/best": 1200.0, "full/32-true": 500.0, "full/32-true_tf32": 600.0}
    runs: list[Any] = []
    monkeypatch.setattr(gpu_mfu, "measured", dictated(speeds, runs))
    mfu = {r["name"].split("/", 3)[3]: r for r in gpu_mfu.mfu(gpu_settings.SMOKE, tmp_path)}
    # llama_micro (hidden 64, MLP 176, the sample's 8,192 tokens): q/k/v/o 64 × 64, gate and
    # up 176 × 64, down 64 × 176, the head 8192 × 64; the MLP's 176 rounded up to 192
    gemms = {"64x64", "176x64", "64x176", "8192x64", "192x64", "64x192"}
    assert mfu.keys() == {*speeds, "full/liger"} | {f"gemm/{g}" for g in gemms}
    assert mfu["gemm/192x64"]["padded_from"] == (176, 64)
    assert mfu["gemm/64x64"]["tokens"] == 2 * 32  # the smoke's micro-batch of 2 × 32 tokens
    assert all(0 < t < 1e3 for g in gemms for t in mfu[f"gemm/{g}"]["tflops"].values())
    liger = mfu["full/liger"]  # a CPU has no Triton: refused in the harness's one line
    assert liger["status"] == "refused" and "liger" in liger["error"], liger
    assert all(mfu[k]["status"] == "ok" for k in speeds), {k: mfu[k] for k in speeds}
    for k, tok_s in speeds.items():  # 64 tokens a step
        assert mfu[k]["tokens_per_s"] == tok_s and mfu[k]["batch"] == 2
        assert mfu[k]["ms_per_step"] == pytest.approx(1e3 * 64 / tok_s)
    assert mfu["full/compile"]["speedup"] == 1.5 and mfu["full/loss_chunk"]["speedup"] == 0.99
    assert mfu["full/best"]["levers"] == ["multi_tensor", "compile"]
    assert mfu["full/best_padded"]["levers"] == ["multi_tensor", "compile", "mlp_64"]
    assert (mfu["full/best"]["target"], mfu["full/best_padded"]["target"]) == (0.4, 0.45)
    assert mfu["full/best"]["met"] is None  # a CPU has no peak FLOP/s: no MFU, no verdict
    # the padded MLP is a bigger model: 2 layers × 3 × 64 × 16 more weights, and their states
    assert mfu["full/mlp_64"]["peak_bytes"] > mfu["full/baseline"]["peak_bytes"]
    assert mfu["galore/best"]["ratio_to_full"] == 0.5  # 800 over full's best 1600
    assert mfu["apollo/best"]["levers"] == ["multi_tensor", "compile"]
    assert mfu["full/32-true_tf32"]["levers"] == ["tf32"]
    # what each run was given: the lever's keys over the baseline's, each method's own
    train = [(r.train.update_chunk, r.train.compile, r.train.loss_chunk,
              r.model_options.mlp_multiple_of, r.train.precision) for r in runs]
    chunk, bf16 = 1 << 24, "bf16-true"
    assert train[:7] == [(0, False, 0, None, bf16), (chunk, False, 0, None, bf16),
                         (0, True, 0, None, bf16), (0, False, 16, None, bf16),
                         (0, False, 0, 64, bf16), (chunk, True, 0, None, bf16),
                         (chunk, True, 0, 64, bf16)]
    assert train[7:10] == [(chunk, True, 0, None, bf16)] * 3
    assert [r.method["name"] for r in runs[7:10]] == ["galore", "adam8bit", "apollo"]
    assert [r.train.precision for r in runs[10:]] == ["32-true"] * 2
    assert [r.train.tf32 for r in runs[10:]] == [False, True]


def test_the_estimate_part_measures_every_method_on_a_device_and_three_in_the_smoke(
        monkeypatch):
    """A GPU run measures every `harness bench memory` label at each preset; the smoke run's
    three only, since tests/bench/test_bench.py runs every one at the smoke's sizes."""
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(gpu_parts, "method_records", lambda label, preset, *sizes: (
        asked.append((preset, label)), [{"name": f"memory/{preset}/{label}/param_bytes"}])[1])
    records = list(gpu_parts.estimate(gpu_parts.GPU, Path("unused")))
    assert asked == [(p, label) for p in ("llama_60m", "llama_350m") for label in METHODS]
    assert len(METHODS) > 20 and records[0]["name"] == "gpu/memory/llama_60m/full/param_bytes"
    asked.clear()
    list(gpu_parts.estimate(gpu_parts.SMOKE, Path("unused")))
    assert asked == [("llama_micro", label) for label in METHODS
                     if label in ("full", "qgalore", "apollo_mini_int8_layerwise")]
    assert len(asked) == 3


def test_a_part_past_its_cap_is_killed_and_says_so(tmp_path):
    start = time.monotonic()
    part = run_part("estimate", tmp_path, cap_s=2, smoke=True)
    assert part["status"] == "timeout" and time.monotonic() - start < 30
    assert part["records"] == [] and "error" in part
    assert list(tmp_path.iterdir()) == []  # its log and records file are not left behind


def test_a_folder_of_the_other_kind_is_refused(tmp_path):
    write_json(tmp_path / "gpu.json", {"smoke": True, "environment": None, "parts": {}})
    with pytest.raises(UserError, match="holds --smoke's figures; a GPU run needs another"):
        load_state(tmp_path, smoke=False)
    assert load_state(tmp_path, smoke=True)["parts"] == {}


def test_every_cap_fits_one_ten_minute_device_command():
    assert all(cap <= 9 for cap in CAPS.values())


def test_junit_counts_and_names_the_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" skipped="1" failures="1" errors="0">'
        '<testcase classname="tests.gpu.test_gpu" name="test_a"/>'
        '<testcase classname="tests.gpu.test_gpu" name="test_b">'
        '<failure message="assert nan is finite&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.gpu.test_gpu" name="test_c"><skipped/></testcase>'
        '<testcase classname="tests.gpu.test_gpu" name="test_d"/></testsuite></testsuites>')
    record = _junit(xml, 1, "")
    assert (record["value"], record["failed"], record["skipped"]) == (2, 1, 1)
    assert record["failures"] == ["tests.gpu.test_gpu::test_b: assert nan is finite"]
    assert record["met"] is False


def cap_at_the_first_outcome(records: Path) -> Callable[..., int]:
    """`Popen.wait` whose timeout (the part's cap) runs out as soon as `records` holds a whole
    outcome: a fixed cap saw none under CI's load, where the part's and its pytest's start-up
    alone took longer; the kill that follows is the cap's."""
    wait = subprocess.Popen.wait

    def capped(self: subprocess.Popen, timeout: float | None = None) -> int:
        if timeout is None:
            return wait(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.poll() is None:
            if records.exists() and "\n" in records.read_text():
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return wait(self, max(0.0, deadline - time.monotonic()))

    return capped


def test_a_tests_part_cut_off_at_its_cap_keeps_the_outcomes_it_had(tmp_path, monkeypatch):
    """pytest's report comes at the end, which a cap never lets it reach: each outcome is
    appended as it comes, and the page counts them and names the failures."""
    capped = cap_at_the_first_outcome(tmp_path / "tests.jsonl")
    monkeypatch.setattr(subprocess.Popen, "wait", capped)
    part = run_part("tests", tmp_path, cap_s=600, smoke=True)
    assert part["status"] == "timeout"
    outcomes = part["records"]
    assert outcomes and all(o["name"].startswith("gpu/test/tests/gpu/") for o in outcomes)
    assert not any(r["name"] == "gpu/tests" for r in outcomes)  # no summary: pytest was killed
    failed = {**outcomes[0], "outcome": "failed", "message": "AssertionError: loss is nan"}
    state = {"smoke": True, "environment": None,
             "parts": {"tests": {**part, "records": [failed, *outcomes[1:]]}}}
    page = render(state)
    assert f"cut off at the cap after {len(outcomes)} outcomes: passed" in page
    assert "failed 1, skipped" in page and "(call): AssertionError: loss is nan" in page


def test_parts_and_cap_choose_what_runs_and_how_long(tmp_path):
    """--parts runs only those, in the kit's order; --cap-min replaces every part's cap; a part
    that is no part is refused in one line naming the six."""
    start = time.monotonic()
    done = harness("bench", "gpu", "--out", str(tmp_path), "--smoke", "--parts",
                   "loop,estimate", "--cap-min", "0.05", cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.index("estimate: timeout") < done.stdout.index("loop: timeout")
    parts = read_json(tmp_path / "gpu.json")["parts"]
    assert list(parts) == ["estimate", "loop"] and {p["cap_s"] for p in parts.values()} == {3.0}
    assert time.monotonic() - start < 60
    bad = harness("bench", "gpu", "--out", str(tmp_path), "--smoke", "--parts", "tests,gemm",
                  cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "no part gemm; the parts are tests, estimate, table11, mfu, loop, llama7b" in bad.stderr


def test_the_lease_script_runs_its_parts_each_in_its_folder(tmp_path):
    """scripts/gpu_lease.sh on a 15-minute lease: the memory parts side by side, then mfu
    alone, each kit in its own folder. Scaled so that every cap is a second: the
    structure is what is checked here; the smoke run above checks the parts."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_lease.sh"), str(tmp_path),
                           "0.004"], env={**os.environ, "GPU_LEASE_SMOKE": "1"}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    folders = {p.name: list(read_json(p / "gpu.json")["parts"]) for p in tmp_path.iterdir()}
    assert folders == {name: [name] for name in ("tests", "estimate", "llama7b", "table11", "mfu")}
    caps = {n: p["cap_s"] for f in tmp_path.iterdir()
            for n, p in read_json(f / "gpu.json")["parts"].items()}
    # 4.5, 5.5 and 3.5 minutes scaled by 0.004: 1.08, 1.32 and 0.84 s
    assert caps == pytest.approx({"tests": 1.08, "estimate": 1.08, "table11": 1.08,
                                  "llama7b": 1.32, "mfu": 0.84})


def test_the_page_shows_each_part_with_its_machine():
    env = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "gpu_memory": "81559 MiB",
           "cuda": "13.0", "torch": "2.11.0", "bitsandbytes": "0.50.2", "transformers": "5.17.0",
           "date": "2026-12-01", "command": "harness bench gpu --out k"}
    loop = {"name": "gpu/loop/llama_350m/bf16-mixed", "value": 0.99, "target": 0.98, "met": True,
            "rounds": [{"round": 1, "harness_tok_s": 99000.0, "bare_tok_s": 100000.0,
                        "ratio": 0.99}]}
    state = {"smoke": False, "environment": env,
             "parts": {"loop": {"status": "ok", "seconds": 80.5, "cap_s": 240.0,
                                "environment": env, "records": [loop]}}}
    page = render(state)
    assert "| 1 | 99,000 | 100,000 | 0.990 |" in page
    assert "median ratio 0.990, target ≥ 0.98: met" in page
    assert "ok in 80.5 s (cap 240 s) on NVIDIA H100 80GB HBM3, driver 580.159.04" in page
    assert page.count("Not run yet.") == 5
    json.dumps(state)  # what gpu.json holds is JSON as it is


def test_the_gemm_probe_takes_llama_1bs_matmuls_and_its_mlp_rounded_up_to_64():
    """GaLore's LLaMA-1B (hidden 2048, MLP 5461, 32K tokens here): four distinct matmul shapes
    (q/k/v/o, gate and up, down, the head; the input embedding is a lookup), and the two MLP
    shapes again at 5504, the next multiple of 64."""
    assert gemm_shapes("llama_1b", 32000) == [
        (2048, 2048, None), (2048, 5461, None), (5461, 2048, None), (32000, 2048, None),
        (2048, 5504, (2048, 5461)), (5504, 2048, (5461, 2048))]


def test_the_mfu_section_shows_each_lever_the_best_against_its_target_and_the_probe():
    """A GPU run's records, written by hand: the baseline, a lever, the best at the paper's
    width, a method with the best levers, a refused lever, and a matmul of the probe."""
    run = {"status": "ok", "batch": 64, "mfu": 0.143, "peak_bytes": 50_970_000_000}
    records = [
        {"name": "gpu/mfu/llama_1b/gemm/2048x5504", "tokens": 16384, "out": 2048,
         "in": 5504, "padded_from": [2048, 5461], "peak_tflops": 989.0,
         "tflops": {"forward": 612.3, "input_grad": 598.04, "weight_grad": 571.0}},
        {"name": "gpu/mfu/llama_1b/full/baseline", "levers": [], **run,
         "tokens_per_s": 18888.0, "ms_per_step": 867.43},
        {"name": "gpu/mfu/llama_1b/full/compile", "levers": ["compile"], **run,
         "tokens_per_s": 37776.0, "mfu": 0.286, "ms_per_step": 433.7, "speedup": 2.0},
        {"name": "gpu/mfu/llama_1b/full/liger", "levers": ["liger"], "batch": 64,
         "status": "refused", "error": "model_options.kernels: liger needs Triton"},
        {"name": "gpu/mfu/llama_1b/full/best", "levers": ["compile"], **run,
         "tokens_per_s": 52000.0, "mfu": 0.41, "ms_per_step": 315.1, "speedup": 2.753,
         "target": 0.4, "met": True},
        {"name": "gpu/mfu/llama_1b/galore/best", "levers": ["compile"], **run,
         "tokens_per_s": 41600.0, "ms_per_step": 393.8, "ratio_to_full": 0.8}]
    part = {"status": "ok", "seconds": 200.0, "cap_s": 540.0, "environment": {},
            "records": records}
    page = render({"smoke": False, "environment": None, "parts": {"mfu": part}})
    assert "| full/baseline | none | 18,888 | 14.3% | 867.4 | 50.97 |  |" in page
    assert "| full/compile | compile | 37,776 | 28.6% | 433.7 | 50.97 | 2.00× |" in page
    assert "| galore/best | compile | 41,600 | 14.3% | 393.8 | 50.97 | 0.80× full's best |" in page
    assert "| full/liger | liger |  |  |  | refused |  |" in page
    assert "- full/liger: refused: model_options.kernels: liger needs Triton" in page
    assert "Best at the paper's MLP width: MFU 41.0%, target ≥ 40%: met." in page
    assert "at 16,384 tokens, bf16, TFLOP/s (the device's peak: 989)" in page
    assert "| 2048 × 5504 | 2048 × 5461 | 612.3 | 598 | 571 |" in page


def test_bench_gpu_without_out_is_one_line_naming_the_flag(capsys):
    from harness.cli import main

    assert main(["bench", "gpu", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "--out DIR is required" in err and err.count("\n") == 1
