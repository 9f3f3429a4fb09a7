"""Every `--json` writes JSON alone on stdout, so `harness ... --json | jq .` works; progress
lines (the trainer's, child processes') go to stderr. Captured at the file descriptor (capfd),
where child processes and C libraries write too. The costlier bench commands (memory, launch,
optim) are parsed the same way in tests/bench/test_bench.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import FINISHED_SWEEP, REPO, harness, write_yaml

from harness.bench.memory import METHODS
from harness.bench.syncs import VARIANTS
from harness.cli import main


def json_out(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[object, str]:
    """Run the command; its stdout parsed whole (json.loads, no slicing) and its stderr."""
    assert main(list(argv)) == 0
    out, err = capfd.readouterr()
    return json.loads(out), err


def test_bench_loop_json_pipes_into_a_json_reader():
    """The issue's case, as a user runs it: the child runs' `model …` and `step …` lines used
    to come before the array on stdout."""
    done = harness("bench", "loop", "--model", "llama_micro", "--steps", "3", "--seq-len", "32",
                   "--batch-size", "1", "--rounds", "1", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = json.loads(done.stdout)
    assert record["name"] == "loop/llama_micro/32-true/cpu" and record["ratio"] > 0
    assert "model llama_micro:" in done.stderr and "step 3/3" in done.stderr


def test_bench_syncs_json(capfd):
    """Every method and variant, three counted steps each (after the bench's two warm-ups):
    no host read of a tensor value, except one under 16-mixed with GaLore's optimizer, which
    has no fused kernel: torch's GradScaler then reads found_inf once a device
    (`sum(v.item() for v in found_inf_per_device.values())` in `_maybe_opt_step`), called from
    our precision step. Fused AdamW takes found_inf into its kernel and reads nothing. (Its 42 s
    are the 22 trainers' set-up: one counted step instead of three saves nothing.)"""
    records, _ = json_out(capfd, "bench", "syncs", "--preset", "llama_micro", "--steps", "3",
                            "--seq-len", "32", "--batch-size", "1", "--json")
    reads = {r["name"].removeprefix("syncs/llama_micro/"): r["value"] for r in records}
    assert reads.keys() == set(METHODS) | set(VARIANTS)  # bench memory's (the registry's)
    assert len(VARIANTS) == 7 and len(reads) == len(METHODS) + 7  # and syncs' own variants
    assert {"full", "galore", "qgalore", "adam_mini", "muon", "full+16-mixed", "galore+16-mixed",
            "full+offload", "full+accumulation"} <= reads.keys()
    assert reads == {name: float(name == "galore+16-mixed") for name in reads}
    for r in records:
        assert sum(r["sites"].values()) == r["value"] and r["cuda_syncs_per_step"] == 0  # CPU
    (site,) = next(r["sites"] for r in records if r["name"].endswith("galore+16-mixed"))
    assert site.startswith("modifiers/precision.py:")


def test_estimate_json(capfd):
    records, _ = json_out(capfd, "estimate", str(REPO / "sweeps" / "quickstart.yaml"), "--json")
    assert len(records) == 18  # nine methods at two learning rates
    assert all(r["weight_bytes"] > 0 and r["trial"].startswith(r["method"]) for r in records)


def test_plan_json(capfd):
    plan, _ = json_out(capfd, "plan", "llama_micro", "--memory", "1GB", "--seq-len", "64",
                       "--json")
    assert plan["budget_bytes"] == 10**9 and plan["fits"]


def test_status_json_writes_null_for_what_a_trial_has_not_reported(finished_run, tmp_path,
                                                                   capfd):
    runs = Path(shutil.copytree(finished_run, tmp_path / "runs"))
    pending = next((runs / "trials").iterdir())
    for name in ("summary.json", "metrics.jsonl"):
        (pending / name).unlink(missing_ok=True)
    records, _ = json_out(capfd, "status", str(runs), "--json")
    assert sorted(r["method"] for r in records) == sorted(FINISHED_SWEEP["methods"])
    by_id = {r["trial"]: r for r in records}
    assert by_id.pop(pending.name)["eval_ppl"] is None  # NaN is not JSON; null is
    (done,) = by_id.values()
    assert done["status"] == "ok" and done["step"] == 4 and math.isfinite(done["eval_ppl"])


def test_status_json_and_watch_are_refused_together(finished_run, capfd):
    with pytest.raises(SystemExit) as stop:
        main(["status", str(finished_run), "--json", "--watch"])
    assert stop.value.code == 2
    assert "not allowed with argument" in capfd.readouterr().err


def test_a_user_error_under_json_leaves_stdout_empty(tmp_path, capfd):
    bad = write_yaml(tmp_path / "bad.yaml", {"name": "x", "methods": {"ful": {}}})
    assert main(["estimate", str(bad), "--json"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1 and "unknown method 'ful'" in err
