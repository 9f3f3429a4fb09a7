"""Issue 70, item 6: a sweep keeps the final model of each method's best trial per model and
token budget (`keep_models: best`), all of them, or none; a trial that has not ended ok is
never touched, a later run decides again, a dropped model is said to be dropped by `harness
status`, `harness export` and a finished trial run again, and the dry run counts what is
kept. Fake trial folders: no trial trains here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import micro_run, write_yaml

from harness.analysis.status import status_records, status_table
from harness.cli_sweep import load_trials
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.sweep.plan.expand import expand, load_sweep
from harness.sweep.plan.forecast import kept_after
from harness.sweep.run.driver import run_sweep
from harness.sweep.run.keep import keep_models
from harness.sweep.search.open import open_search
from harness.train.export import export_trial, is_finished
from harness.trials import RunsDir, TrialDir

MODEL_BYTES = 1000  # each fake model: one file of this size


def sweep_of(tmp_path: Path, keep: str = "best", **search) -> object:
    """A grid of full and lora at two LRs on llama_micro (8 steps of 4 x 32 tokens)."""
    run = micro_run(steps=8)
    return load_sweep(write_yaml(tmp_path / "s.yaml", {
        "name": "s", "model": "llama_micro", "device": "cpu", "task": run["task"],
        "train": run["train"], "methods": {"full": {}, "lora": {"rank": 4}},
        "search": {"space": {"train.lr": [0.001, 0.003]}, **search},
        "keep_models": keep}), {})


def trial(out: Path, name: str, status: str = "ok", steps: int = 8, model: bool = True,
          budget: int | None = None, **summary) -> TrialDir:
    """A trial folder as a finished one leaves it: config (its label, model, steps and the
    sweep's budget it belongs to), summary and, when `model`, a final model and its record."""
    t = RunsDir(out).trial(name)
    label = name.split("-")[0]
    train = {"steps": steps, "batch_size": 2, "total_batch_size": 4,
             **({"budget": {"tokens": budget}} if budget else {})}
    write_yaml(t.config, {"label": label, "model": "llama_micro", "train": train,
                          "task": {"seq_len": 32}})
    t.write_summary({"trial": name, "status": status, "method": label, **summary,
                     **({"keep_final": "weights", "final_model_bytes": MODEL_BYTES}
                        if model else {})})
    if model:
        t.final_model.mkdir()
        (t.final_model / "model.safetensors").write_bytes(b"\0" * MODEL_BYTES)
        t.final_model.with_name("model.json").write_text(json.dumps({"bytes": MODEL_BYTES}))
    return t


def kept(trials: list[TrialDir]) -> list[str]:
    return [t.name for t in trials if t.final_model.exists()]


def test_each_methods_best_trial_per_model_and_budget_keeps_its_model(tmp_path):
    """full at 8 steps: ppl 30 and 20, the second kept; full at 16 steps (another budget):
    alone, kept; lora: 40 and 35, the second kept. The others' models go, their summaries
    say why and which trial kept its model, and nothing else of them is touched."""
    out = tmp_path / "runs"
    trials = [trial(out, "full-a", eval_ppl=30.0), trial(out, "full-b", eval_ppl=20.0),
              trial(out, "full-c", steps=16, eval_ppl=25.0),
              trial(out, "lora-a", eval_ppl=40.0), trial(out, "lora-b", eval_ppl=35.0)]
    line = keep_models(sweep_of(tmp_path), trials)
    assert kept(trials) == ["full-b", "full-c", "lora-b"]
    assert line is not None and "dropped the final models of 2 trials (0.0 MB)" in line
    for name, best in (("full-a", "full-b"), ("lora-a", "lora-b")):
        t = RunsDir(out).trial(name)
        summary = t.read_summary()
        assert summary.get("final_model_dropped") == "not best"
        assert summary.get("final_model_kept_by") == best
        assert summary.get("eval_ppl") is not None and t.config.is_file()
        assert not t.final_model.with_name("model.json").exists()
    assert "final_model_dropped" not in json.loads(RunsDir(out).trial("full-b").summary
                                                   .read_text())


def test_a_budget_of_the_sweep_groups_its_trials_whatever_their_steps(tmp_path):
    """Two trials of full in the sweep's 1,000,000-token budget (steps rounded apart) are one
    group; a third in its 2,000,000-token budget is another."""
    out = tmp_path / "runs"
    trials = [trial(out, "full-a", steps=7812, budget=1_000_000, eval_ppl=20.0),
              trial(out, "full-b", steps=7813, budget=1_000_000, eval_ppl=21.0),
              trial(out, "full-c", steps=15625, budget=2_000_000, eval_ppl=25.0)]
    keep_models(sweep_of(tmp_path), trials)
    assert kept(trials) == ["full-a", "full-c"]


def test_a_maximized_metric_keeps_the_highest(tmp_path):
    out = tmp_path / "runs"
    trials = [trial(out, "full-a", eval_score=0.7), trial(out, "full-b", eval_score=0.6)]
    keep_models(sweep_of(tmp_path, metric="eval_score", direction="maximize"), trials)
    assert kept(trials) == ["full-a"]


def test_running_and_resumable_trials_are_never_dropped(tmp_path):
    """A running trial (this process's pid), an interrupted one with a checkpoint and a failed
    one (run again by --retry-failed) keep whatever they hold, though the ok trial of their
    group is the best; a group with no metric at all keeps every model."""
    out = tmp_path / "runs"
    best = trial(out, "full-a", eval_ppl=10.0)
    running = trial(out, "full-b", "running", model=False, eval_ppl=50.0, pid=os.getpid())
    stopped = trial(out, "full-c", "interrupted", model=False, eval_ppl=60.0)
    stopped.checkpoints.mkdir()
    (stopped.checkpoint).write_bytes(b"state")
    failed = trial(out, "full-d", "failed", model=False)
    unranked = [trial(out, "lora-a"), trial(out, "lora-b")]
    before = {t.name: t.summary.read_text() for t in (running, stopped, failed)}
    assert keep_models(sweep_of(tmp_path), [best, running, stopped, failed, *unranked]) is None
    assert kept([best, *unranked]) == ["full-a", "lora-a", "lora-b"]
    assert stopped.checkpoint.read_bytes() == b"state"
    assert {t.name: t.summary.read_text() for t in (running, stopped, failed)} == before


def test_a_later_run_decides_again(tmp_path):
    """Run 1: full-a (ppl 30) is the only one ended, so it keeps its model while full-b is
    interrupted. Run 2: full-b ends at ppl 20: it keeps its model and full-a's goes. A kill
    between a mark and the files going leaves them: the next run removes them."""
    out = tmp_path / "runs"
    sweep = sweep_of(tmp_path)
    a = trial(out, "full-a", eval_ppl=30.0)
    b = trial(out, "full-b", "interrupted", model=False, eval_ppl=25.0)
    assert keep_models(sweep, [a, b]) is None and kept([a]) == ["full-a"]
    b = trial(out, "full-b", eval_ppl=20.0)
    keep_models(sweep, [a, b])
    assert kept([a, b]) == ["full-b"]
    assert a.read_summary().get("final_model_kept_by") == "full-b"
    c = trial(out, "full-c", eval_ppl=21.0, final_model_dropped="not best")  # killed midway
    keep_models(sweep, [a, b, c])
    assert kept([a, b, c]) == ["full-b"]


@pytest.mark.parametrize(("keep", "want"), [("all", ["full-a", "full-b", "lora-a"]),
                                            ("none", [])])
def test_keep_models_all_keeps_every_model_and_none_drops_them_all(tmp_path, keep, want):
    out = tmp_path / "runs"
    trials = [trial(out, "full-a", eval_ppl=30.0), trial(out, "full-b", eval_ppl=20.0),
              trial(out, "lora-a", eval_ppl=40.0)]
    keep_models(sweep_of(tmp_path, keep), trials)
    assert kept(trials) == want
    if keep == "none":
        assert trials[1].read_summary().get("final_model_dropped") == "keep_models: none"


def test_keep_models_accepts_best_all_none_and_refuses_others(tmp_path):
    assert sweep_of(tmp_path).keep_models == "best"  # the default
    with pytest.raises(UserError, match=r"keep_models"):
        sweep_of(tmp_path, "some")


def test_a_dropped_model_is_said_to_be_dropped(tmp_path):
    """`harness status` shows it in its final-model column and its --json records; `harness
    export` says so in one line, naming the trial kept; the trial run again is finished, not
    trained again."""
    out = tmp_path / "runs"
    run = load_run(micro_run(steps=8))
    a = trial(out, "full-a", eval_ppl=30.0, identity=run.identity())
    b = trial(out, "full-b", eval_ppl=20.0)
    keep_models(sweep_of(tmp_path), [a, b])
    rows = {line.split("|")[1].strip(): line
            for line in status_table(load_trials(str(out))).splitlines() if "|" in line}
    assert "| dropped (not best) |" in rows["full-a"] and "dropped" not in rows["full-b"]
    records = {r["trial"]: r for r in json.loads(status_records(load_trials(str(out))))}
    assert records["full-a"]["final_model_dropped"] == "not best"
    assert records["full-b"]["final_model_dropped"] is None
    with pytest.raises(UserError, match=r"^[^\n]*full-a: its final model was dropped \(not "
                                        r"best\)[^\n]*full-b kept its model[^\n]*$"):
        export_trial(a.path, tmp_path / "export")
    assert is_finished(run, a, a.read_summary())


def test_a_sweep_drops_the_models_as_its_run_ends(tmp_path):
    """The driver's hook, with the grid's own trials finished by hand (none trains): of each
    method's two LRs the lower ppl keeps its model."""
    sweep, out = sweep_of(tmp_path), tmp_path / "runs"
    dirs = open_search(sweep, out).trial_dirs()
    for t, ppl in zip(dirs, [30.0, 20.0, 40.0, 50.0], strict=True):
        trial(out, t.name, eval_ppl=ppl)
    assert run_sweep(sweep, out) == 0
    assert kept(dirs) == [dirs[1].name, dirs[2].name]


@pytest.mark.parametrize(("keep", "want"), [("best", ("best", 2 * 100 + 4 * 7)),
                                            ("none", ("none", 4 * 7)), ("all", None)])
def test_the_dry_run_counts_what_keep_models_leaves(tmp_path, keep, want):
    """Four trials of 100-byte models beside 7 bytes of checkpoints each: best keeps one model
    of full's two LRs and one of lora's, none keeps the checkpoints alone, all drops nothing."""
    sweep = sweep_of(tmp_path, keep)
    records = [{"final_model_bytes": 100, "disk_kept_bytes": 107}] * 4
    assert kept_after(sweep, expand(sweep), records) == want
