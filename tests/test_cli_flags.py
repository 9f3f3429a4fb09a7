"""Flags the docs show that no other test ran (tests/test_docs.py finds them): each run through
the real command line and checked for its effect, not only for exit 0."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, harness, harness_here, micro_run, write_yaml

from harness.cli import build_parser, main

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


def test_version_names_the_installed_harness_torch_and_python(capsys) -> None:
    import platform
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == (f"harness {version('harness')} (torch {version('torch')}, "
                                       f"python {platform.python_version()})\n")


def test_help_and_version_import_neither_torch_nor_transformers() -> None:
    """`harness --help` answers at once: building the parser loads no heavy room (each command
    imports its own when it runs). In a fresh interpreter, where nothing else loaded them."""
    code = ("import sys, contextlib, io, harness.cli\n"
            "for argv in (['--help'], ['sweep', '--help'], ['--version']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        harness.cli.main(argv)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'pandas', 'optuna', 'pydantic')\n"
            "             if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_status_reads_a_run_folder_without_importing_torch(tmp_path) -> None:
    """`harness status` only reads the run folder (and asks a scheduler of a trial's job): in a
    fresh interpreter it prints its table without loading torch, whose import was most of the
    command's time (the trials' checkpoint modules and the launchers' CPU counting load it only
    when used). make_runs: t0..t4 and t10, a mix of ends."""
    sys.path.insert(0, str(REPO / "tests" / "analysis"))
    from test_report import make_runs

    runs = make_runs(tmp_path / "runs")
    code = ("import sys, harness.cli\n"
            f"code = harness.cli.main(['status', {str(runs)!r}])\n"
            "print('torch' in sys.modules, code, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "False 0", done.stderr
    assert {"t0", "t2", "t4", "t10"} <= set(done.stdout.split())  # the table, one row a trial


def test_a_finished_sweep_counts_its_trials_and_names_those_that_failed(tmp_path, capsys) -> None:
    """The per-trial table is `harness status`'s and the results `harness report`'s: a sweep
    ends with its outcome in one line (so `harness sweep X && harness report X` prints each
    table once), each trial that failed named with its error. make_runs: t0, t1, t3 ok; t2
    nan and t4 failed ("diverged"); t10 never started."""
    sys.path.insert(0, str(REPO / "tests" / "analysis"))
    from test_report import make_runs

    from harness.cli_sweep import show_outcome

    runs = make_runs(tmp_path / "runs")
    show_outcome(runs)
    assert capsys.readouterr().out.splitlines() == [
        f"6 trials in {runs}: 3 ok, 1 pending, 1 failed, 1 nan (one row each: harness status "
        f"{runs}; tables and figures: harness report {runs})",
        "  t2 nan: diverged", "  t4 failed: diverged"]


def search_sweep(tmp_path: Path) -> Path:
    """One ReLoRA trial (a merge every 2 steps) sampled by an Optuna study."""
    data = {k: v for k, v in micro_run(steps=4).items() if k in ("model", "task", "train")}
    data.update(name="loud", eval={"every": 0, "tokens": 64},
                methods={"relora": {"rank": 4, "reset_every": 2, "restart_warmup_steps": 1}},
                search={"sampler": "random", "n_trials": 1,
                        "space": {"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}})
    return write_yaml(tmp_path / "loud.yaml", data)


def test_internal_lines_reach_the_terminal_only_under_verbose(tmp_path) -> None:
    """A trial's threads, ReLoRA's merges, Optuna's study notices and its ExperimentalWarning
    (fail_stale_trials, called by the harness): in the trial's stderr.log, not on the terminal;
    `--verbose` (after the command or before it) shows them. The sweep prints no per-trial
    table, its outcome in one line."""
    sweep = search_sweep(tmp_path)
    quiet = harness("sweep", str(sweep), "--out", str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    terminal = quiet.stdout + quiet.stderr
    for internal in ("relora_merge", "threads:", "A new study created", "ExperimentalWarning",
                     "Using an existing study"):
        assert internal not in terminal
    (log,) = (tmp_path / "quiet").glob("trials/relora-*/stderr.log")
    assert "step 2: relora_merge 1" in log.read_text() and "\nthreads: " in log.read_text()
    out = tmp_path / "quiet"
    assert f"1 trial in {out}: 1 ok (one row each: harness status {out}" in quiet.stdout
    assert "| id " not in quiet.stdout and "| id " in harness_here("status", str(out)).stdout
    # Before the command or after it, `main` reads the same flag (one sweep shows its effect).
    parser = build_parser()
    assert parser.parse_args(["sweep", str(sweep)]).verbose is False
    for argv in (["sweep", str(sweep), "--verbose"], ["-v", "sweep", str(sweep)]):
        assert parser.parse_args(argv).verbose is True
    loud = harness("sweep", str(sweep), "--out", str(tmp_path / "loud"), "--verbose")
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert re.search(r"^\[relora-\w+\] step 2: relora_merge 1", loud.stdout, re.MULTILINE)
    assert re.search(r"^\[relora-\w+\] threads: \d+$", loud.stdout, re.MULTILINE)
    assert "A new study created" in loud.stderr and "ExperimentalWarning" in loud.stderr
