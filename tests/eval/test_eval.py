"""`harness eval`: lm-evaluation-harness on a trial's exported model, the offline task built
from the sample corpus, eval.json merged, the report's table, and each bad input's one line.

One module fixture scores a random llama_micro (exported as a finished trial writes it) through
the CLI in this process; the scores are checked against log-likelihoods computed here with
the model itself."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import harness_here, micro_model

from harness.analysis.downstream import downstream_table
from harness.analysis.load import load_runs
from harness.data.c4 import load_tokenizer
from harness.eval import sample_task
from harness.train.build import generation_ready
from harness.train.plain import save_plain
from harness.trials import TrialDir, write_json, write_yaml

LIMIT = 24
STALE = {"metrics": {"acc": 9.0}, "stderr": {}, "n": 1}  # an older score of the offline task
OTHER = {"metrics": {"acc_norm": 0.5}, "stderr": {"acc_norm": 0.1}, "n": 10, "n_total": 10}


def trial_folder(runs: Path, name: str, status: str, task: str = "pretrain") -> TrialDir:
    trial = TrialDir(runs / "trials" / name)
    trial.path.mkdir(parents=True)
    write_yaml(trial.config, {"name": "t", "task": {"kind": task}, "train": {"lr": 0.001}})
    write_json(trial.summary, {"status": status, "method": name.split("-")[0], "lr": 0.001,
                               "eval_ppl": 1234.5})
    return trial


def exported(runs: Path, name: str) -> tuple[TrialDir, Any, Any]:
    """A finished trial whose final model is a random llama_micro, written as training does."""
    trial = trial_folder(runs, name, "ok")
    tok = load_tokenizer("sample")
    model = micro_model(seed=1)
    generation_ready(model, tok)
    save_plain(model, tok, trial.final_model, step=6)
    return trial, model.eval(), tok


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    runs = tmp_path_factory.mktemp("runs")
    trial, model, tok = exported(runs, "full-1a2b3c4d")
    write_json(trial.downstream, {"tasks": {"c4_sample_choice": STALE, "other_task": OTHER}})
    trial_folder(runs, "lora-5e6f7a8b", "running")
    done = harness_here("eval", str(runs), "--tasks", "c4_sample_choice,hellaswag",
                        "--limit", "24", "--batch-size", "4", "--device", "cpu")
    return {"runs": runs, "trial": trial, "model": model, "tok": tok, "done": done,
            "written": json.loads(trial.downstream.read_text())["tasks"]}


def log_likelihood(model: Any, tok: Any, context: str, ending: str) -> float:
    """log p(" " + ending | context), the continuation's tokens those of the whole text past
    the context's, as a causal LM scores them."""
    whole = tok(context + " " + ending, add_special_tokens=False).input_ids
    start = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(start, len(whole)))


def by_hand(model: Any, tok: Any) -> dict[str, list[float]]:
    """Per example of the first LIMIT: 1 where the ending with the highest log-likelihood (for
    acc_norm, per character) is the right one."""
    acc, norm = [], []
    rows = sample_task.examples()[:LIMIT]
    for row in rows:
        lls = [log_likelihood(model, tok, row["context"], e) for e in row["endings"]]
        per_char = [ll / len(e) for ll, e in zip(lls, row["endings"], strict=True)]
        acc.append(float(max(range(4), key=lls.__getitem__) == row["label"]))
        norm.append(float(max(range(4), key=per_char.__getitem__) == row["label"]))
    return {"acc": acc, "acc_norm": norm}


def test_the_scores_equal_log_likelihoods_computed_with_the_model(scored):
    assert scored["done"].returncode == 0, scored["done"].stderr[-2000:]
    entry = scored["written"]["c4_sample_choice"]
    for metric, hits in by_hand(scored["model"], scored["tok"]).items():
        mean = sum(hits) / LIMIT
        sample_sd = math.sqrt(sum((h - mean) ** 2 for h in hits) / (LIMIT - 1))
        assert entry["metrics"][metric] == pytest.approx(mean, abs=1e-12), metric
        assert entry["stderr"][metric] == pytest.approx(sample_sd / math.sqrt(LIMIT)), metric
    assert 0 < entry["metrics"]["acc"] < 1  # a random model: some right, some wrong
    assert (entry["n"], entry["n_total"], entry["limit"]) == (LIMIT, 181, LIMIT)
    assert (entry["version"], entry["model_step"], entry["lm_eval"]) == (1.0, 6, "0.4.13")
    assert f"c4_sample_choice: acc {entry['metrics']['acc']:.4f} ± " in scored["done"].stdout


def test_a_task_whose_data_cannot_be_had_is_one_line_and_the_rest_go_on(scored):
    lines = [line for line in scored["done"].stdout.splitlines() if "hellaswag" in line]
    assert len(lines) == 1 and lines[0].startswith("hellaswag: skipped, its data cannot be had")
    assert "hellaswag" not in scored["written"]


def test_a_runs_directory_scores_its_finished_trials_and_names_the_others(scored):
    out = scored["done"].stdout
    assert "lora-5e6f7a8b: skipped (status running: only a finished trial" in out
    assert "full-1a2b3c4d: c4_sample_choice: acc" in out
    assert not (scored["runs"] / "trials" / "lora-5e6f7a8b" / "eval.json").exists()


def test_eval_json_replaces_the_task_scored_again_and_keeps_the_others(scored):
    assert scored["written"]["other_task"] == OTHER
    assert scored["written"]["c4_sample_choice"]["metrics"]["acc"] != STALE["metrics"]["acc"]
    assert sorted(scored["written"]) == ["c4_sample_choice", "other_task"]


def test_the_sample_task_is_cut_from_the_validation_split():
    """The first example: the first 48 words of the first validation document, its next 12
    the right ending."""
    with gzip.open(sample_task.VALIDATION, "rt") as f:
        docs = [json.loads(line)["text"].split() for line in f]
    rows = sample_task.examples()
    first, second = rows[0], rows[1]
    assert first["context"] == " ".join(docs[0][:48])
    assert first["endings"][first["label"]] == " ".join(docs[0][48:60])
    assert second["context"] == " ".join(docs[0][200:248])  # the next window, 200 words on
    assert [r["label"] for r in rows[:5]] == [0, 1, 2, 3, 0]
    endings = {e for r in rows for e in r["endings"]}
    assert len(rows) == 181 and len(endings) == 181  # each wrong ending another's right one


def scores(runs: Path, name: str, tasks: dict[str, Any], eval_ppl: float = 30.0) -> None:
    trial = trial_folder(runs, name, "ok")
    write_json(trial.summary, {"status": "ok", "method": name.split("-")[0], "lr": 0.002,
                               "eval_ppl": eval_ppl})
    write_json(trial.downstream, {"tasks": tasks})


def test_the_report_has_a_column_per_task_and_their_average(tmp_path):
    def task(acc_norm=None, acc=None, n=100, limit=None):
        metrics = {k: v for k, v in (("acc", acc), ("acc_norm", acc_norm)) if v is not None}
        return {"metrics": metrics, "stderr": {}, "n": n, "n_total": 100, "limit": limit}

    scores(tmp_path, "full-1", {"hellaswag": task(acc=0.30, acc_norm=0.40),
                                "winogrande": task(acc=0.50)})
    scores(tmp_path, "galore-2", {"hellaswag": task(acc_norm=0.25, n=20, limit=20)})
    trial_folder(tmp_path, "lora-3", "ok").downstream.write_text("{not json")
    table, notes = downstream_table(load_runs(tmp_path))
    assert list(table.columns) == ["method", "trial", "lr", "eval ppl", "hellaswag acc_norm",
                                   "winogrande acc", "average"]
    full, galore = table.to_dict("records")
    assert (full["hellaswag acc_norm"], full["winogrande acc"]) == ("0.4000", "0.5000")
    assert full["average"] == "0.4500"  # (0.40 + 0.50) / 2
    assert (galore["winogrande acc"], galore["average"]) == ("", "")  # not every task: none
    assert (full["method"], full["lr"], full["eval ppl"]) == ("full", "0.002", "30.00")
    assert notes[0].startswith("galore-2: scored on part of the examples: hellaswag (20 of 100)")
    assert "lora-3/eval.json: not JSON" in notes[1] and "left out" in notes[1]


def test_the_report_writes_the_table_beside_the_others(tmp_path):
    from harness.analysis import write_report

    scores(tmp_path, "full-1", {"piqa": {"metrics": {"acc": 0.6, "acc_norm": 0.7}, "n": 9}})
    text = write_report(tmp_path)
    assert "Downstream scores" in text and "piqa acc_norm" in text
    assert "| full     | full-1  |" in (tmp_path / "report" / "downstream.md").read_text()
    assert "Downstream scores" in (tmp_path / "report" / "report.md").read_text()


def test_a_task_lm_eval_does_not_know_is_one_line_before_anything_runs(tmp_path):
    trial, _, _ = exported(tmp_path, "full-1")
    done = harness_here("eval", str(trial.path), "--tasks", "c4_sample_choice,no_such_task")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --tasks: no task 'no_such_task' (`lm-eval ls tasks` "
                                   "lists lm-eval's; this harness adds c4_sample_choice)")
    assert not trial.downstream.exists()


def test_a_trial_without_a_final_model_is_one_line(tmp_path):
    trial = trial_folder(tmp_path, "full-1", "ok")
    done = harness_here("eval", str(trial.path), "--tasks", "c4_sample_choice")
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {trial.path}: nothing to evaluate: no final model in "
                                   f"{trial.final_model} (train.keep_final: none, or not kept)")


def test_without_lm_eval_the_line_says_how_to_install(tmp_path, monkeypatch):
    trial, _, _ = exported(tmp_path, "full-1")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as a package that is not installed
    done = harness_here("eval", str(trial.path))
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: harness eval needs lm-evaluation-harness, which is "
                                   "not installed: pip install -e '.[eval]' (lm-eval 0.4.13)")


def test_a_device_that_is_none_is_one_line(tmp_path):
    trial, _, _ = exported(tmp_path, "full-1")
    done = harness_here("eval", str(trial.path), "--tasks", "c4_sample_choice",
                        "--device", "gpu0")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --device gpu0: not a device (allowed: cpu, cuda, "
                                   "cuda:N)")
    assert not trial.downstream.exists()
