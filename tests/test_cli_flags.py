"""Flags the docs show that no other test ran (tests/test_docs.py finds them): each run through
the real command line and checked for its effect, not only for exit 0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, micro_run, write_yaml

from harness.cli import main

QUICKSTART = str(REPO / "sweeps" / "quickstart.yaml")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_set_overrides_every_trial(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set train.batch_size=16` doubles the quickstart's micro-batch of 8: each trial's
    activations (nearly) double and its peak grows by as much; its weights, gradients and
    states stay, and its id changes."""
    plain = run_json(capsys, "estimate", QUICKSTART, "--json")
    doubled = run_json(capsys, "estimate", QUICKSTART, "--set", "train.batch_size=16", "--json")
    assert len(plain) == len(doubled) == 18
    for a, b in zip(plain, doubled, strict=True):
        assert a["method"] == b["method"] and a["trial"] != b["trial"]
        grown = b["activation_bytes"] - a["activation_bytes"]
        assert grown > 0.9 * a["activation_bytes"] and b["peak_bytes"] - a["peak_bytes"] == grown
        for part in ("weight_bytes", "grad_bytes", "optimizer_state_bytes", "extra_bytes"):
            assert a[part] == b[part]


def test_plan_tokenizer_sizes_the_embedding(capsys: pytest.CaptureFixture[str]) -> None:
    """The sample tokenizer's 8,192 tokens against t5-base's 32,100: every configuration both
    plans hold weighs less with the smaller vocabulary."""
    argv = ["plan", "llama_micro", "--memory", "1GB", "--top", "0", "--json"]
    t5 = run_json(capsys, *argv)
    sample = run_json(capsys, *argv, "--tokenizer", "sample")

    def weights(plan: dict) -> dict[tuple, int]:
        return {(c["label"], c["modifiers"], c["precision"], c["micro_batch"]):
                c["breakdown"]["weight_bytes"] for c in plan["fits"]}

    small, large = weights(sample), weights(t5)
    shared = small.keys() & large.keys()
    assert len(shared) > 100 and all(small[k] < large[k] for k in shared)


def test_plan_token_batch_sets_the_sequences_an_update(capsys: pytest.CaptureFixture[str]) -> None:
    """512 tokens an update at 64 a sequence (the default, 256, would be 4 sequences): every
    configuration's micro-batch times its accumulation makes 8 sequences."""
    plan = run_json(capsys, "plan", "llama_micro", "--memory", "1GB", "--seq-len", "64",
                    "--token-batch", "512", "--tokenizer", "sample", "--top", "0", "--json")
    assert plan["fits"]
    assert {c["micro_batch"] * c["accumulation"] for c in plan["fits"]} == {8}


def test_plan_top_limits_the_rows_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama_micro", "--memory", "1GB", "--tokenizer", "sample",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    fits = int(re.match(r"(\d+) configurations of llama_micro fit", out).group(1))
    rows = re.findall(r"^(\d+) {2,}\S", out, re.MULTILINE)
    assert fits > 3 and rows == ["1", "2", "3"]
    assert f"... {fits - 3} more (--top 0 for all" in out


def test_bench_loop_precision_trains_in_that_precision(capsys: pytest.CaptureFixture[str]) -> None:
    """`--precision bf16` (the old name) runs both loops in bf16-mixed and says so."""
    (record,) = run_json(capsys, "bench", "loop", "--model", "llama_micro", "--steps", "3",
                         "--seq-len", "32", "--batch-size", "1", "--rounds", "1",
                         "--precision", "bf16", "--json")
    assert record["name"] == "loop/llama_micro/bf16-mixed/cpu"
    (only,) = record["rounds"]
    assert only["harness_tok_s"] > 0 and only["bare_tok_s"] > 0


def test_report_out_writes_the_report_there(finished_run_copy: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "elsewhere"
    assert main(["report", str(finished_run_copy), "--out", str(out)]) == 0
    assert f"report written to {out} (report.html, report.md)" in capsys.readouterr().out
    assert {"report.html", "report.md", "memory.png"} <= {p.name for p in out.iterdir()}
    assert not (finished_run_copy / "report").exists()  # not the default place as well


def test_train_set_overrides_the_run_config(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--set train.steps=2` on a 6-step config: the run stops at step 2 and records 2."""
    config = write_yaml(tmp_path / "run.yaml", micro_run(steps=6))
    out = tmp_path / "run"
    assert main(["train", str(config), "--set", "train.steps=2", "--out", str(out)]) == 0
    assert f"{out}: ok" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["step"] == 2
