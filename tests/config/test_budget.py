"""Token budgets (harness/config/budget.py, harness/sweep/plan/expand.py): each budget's steps
and warmup by hand, Chinchilla's two parameter counts, WSD's LR, each refusal's one line, the
dry run's budget column and the report's budget columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import write_yaml

from harness.analysis import load_runs
from harness.cli import main
from harness.config import TrainConfig
from harness.config.steps import lr_factor
from harness.errors import UserError
from harness.sweep.plan.expand import expand, load_sweep
from harness.trials import RunsDir

# llama_micro (hidden 64, MLP 176, 2 layers) on the sample tokenizer (8,192 tokens), by hand:
LAYER = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64  # q, k, v, o; gate, up, down; two norms
NON_EMBEDDING = 2 * LAYER + 64  # 100,672: the layers and the final norm
ALL = NON_EMBEDDING + 2 * 8192 * 64  # 1,149,248: the input embedding and the head added
STEP = 8 * 32  # tokens per step: total_batch_size 8 x seq_len 32


def budget_sweep(tmp_path: Path, budget: dict[str, Any], **more: Any) -> Path:
    data = {"name": "b", "model": "llama_micro",
            "task": {"tokenizer": "sample", "seq_len": 32},
            "train": {"batch_size": 4, "total_batch_size": 8},
            "methods": {"full": {}}, "budget": budget, **more}
    return write_yaml(tmp_path / "b.yaml", data)


def planned(path: Path, overrides: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    trials = expand(load_sweep(path, overrides or {}))
    return [(t.run.train.steps, t.run.train.warmup_steps, t.run.train.budget.model_dump())
            for t in trials]


def test_token_budgets_become_whole_steps_and_a_warmup_rounded_half_up(tmp_path):
    path = budget_sweep(tmp_path, {"tokens": [1000, 2560, "1e4"], "warmup": 0.25})
    marks = [{"tokens": t, "chinchilla": None, "params": None, "counted": None}
             for t in (1000, 2560, 10000)]
    # 1000 / 256 = 3.9 -> 3 steps (whole steps within the budget), 0.75 -> 1 warmup step;
    # 2560 / 256 = 10, 2.5 -> 3; 10000 / 256 = 39.06 -> 39, 9.75 -> 10
    assert planned(path) == [(3, 1, marks[0]), (10, 3, marks[1]), (39, 10, marks[2])]


def test_chinchilla_counts_all_parameters_or_those_without_embeddings(tmp_path):
    both = {"chinchilla": [1]}
    (whole,) = planned(budget_sweep(tmp_path, both))
    assert 20 * ALL == 22_984_960  # / 256 = 89,785 steps; a tenth: 8,978.5 -> 8,979
    assert whole == (89_785, 8_979, {"tokens": 22_984_960, "chinchilla": 1.0, "params": "all",
                                     "counted": ALL})
    half = {"chinchilla": [0.5], "params": "non_embedding"}
    (layers,) = planned(budget_sweep(tmp_path, half))
    assert 10 * NON_EMBEDDING == 1_006_720
    assert layers == (3932, 393, {"tokens": 1_006_720, "chinchilla": 0.5,  # 3,932.5 steps
                                  "params": "non_embedding", "counted": NON_EMBEDDING})


def test_each_budget_is_every_method_s_grid_and_the_report_reads_it_back(tmp_path):
    path = budget_sweep(tmp_path, {"tokens": [2560, 5120]},
                        search={"space": {"train.lr": [1e-3, 3e-3]}}, seeds=[0, 1])
    trials = expand(load_sweep(path, {}))
    assert len(trials) == len({t.id for t in trials}) == 2 * 2 * 2
    assert [t.budget.tokens for t in trials] == [2560] * 4 + [5120] * 4
    assert [t.run.train.steps for t in trials] == [10] * 4 + [20] * 4
    runs = RunsDir(tmp_path / "runs")
    for trial in trials:
        runs.trial(trial.id).write_config(trial.run)
    rows = load_runs(tmp_path / "runs").set_index("trial")
    for trial in trials:
        assert rows.loc[trial.id, "budget_tokens"] == trial.budget.tokens
        assert rows.loc[trial.id, "chinchilla"] is None


def test_a_chinchilla_multiple_is_read_back_by_the_report(tmp_path):
    (trial,) = expand(load_sweep(budget_sweep(tmp_path, {"chinchilla": [2]}), {}))
    RunsDir(tmp_path / "runs").trial(trial.id).write_config(trial.run)
    (row,) = load_runs(tmp_path / "runs").to_dict("records")
    assert (row["budget_tokens"], row["chinchilla"]) == (40 * ALL, 2.0)


def test_the_dry_run_shows_each_trial_s_budget(tmp_path, capsys):
    path = budget_sweep(tmp_path, {"chinchilla": [1, 2], "params": "non_embedding"})
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[header.index("budget"):header.index("budget") + 3] == [
        "budget", "steps", "tokens"]
    assert "1x Chinchilla (2,013,440 tokens)  7865     2,013,440" in out
    assert "2x Chinchilla (4,026,880 tokens)  15730    4,026,880" in out


def test_a_sweep_without_budgets_plans_as_before(tmp_path, capsys):
    path = budget_sweep(tmp_path, None, train={"steps": 7, "batch_size": 4,
                                               "total_batch_size": 8})
    (trial,) = expand(load_sweep(path, {}))
    assert (trial.budget, trial.run.train.steps, trial.length) == (None, 7, "7")
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "runs")]) == 0
    assert "budget" not in capsys.readouterr().out.splitlines()[0]


WSD = TrainConfig(steps=20, warmup_steps=2, schedule="wsd", decay_fraction=0.25,
                  min_lr_ratio=0.1)


@pytest.mark.parametrize(("step", "factor"), [
    (0, 0.5), (1, 1.0), (2, 1.0), (10, 1.0), (15, 1.0),  # warmup, then stable up to 20 - 5
    (16, 0.1 + 0.9 * 4 / 5), (18, 0.1 + 0.9 * 2 / 5), (19, 0.1 + 0.9 / 5),  # linear decay
    (20, 0.1), (25, 0.1)])  # the floor at `steps`, as cosine's, and after
def test_wsd_is_constant_after_warmup_then_decays_linearly_to_the_floor(step, factor):
    assert lr_factor(step, WSD) == pytest.approx(factor)


def test_wsd_decays_over_a_fifth_of_the_steps_by_default_and_never_into_the_warmup():
    default = TrainConfig(steps=10, schedule="wsd", min_lr_ratio=0.0)
    assert [lr_factor(s, default) for s in (7, 8, 9, 10)] == [1.0, 1.0, 0.5, 0.0]
    short = TrainConfig(steps=10, warmup_steps=8, schedule="wsd", decay_fraction=0.5,
                        min_lr_ratio=0.0)
    assert [lr_factor(s, short) for s in (7, 8, 9)] == [1.0, 1.0, 0.5]


def test_decay_fraction_belongs_to_wsd():
    with pytest.raises(ValueError, match="decay_fraction applies to schedule wsd only"):
        TrainConfig(schedule="cosine", decay_fraction=0.3)


@pytest.mark.parametrize(("budget", "more", "line"), [
    ({"tokens": [100]}, {}, r"^methods\.full with \{\}: budget\.tokens: 100 tokens is less than "
     r"one optimizer step of 256 tokens \(train\.total_batch_size x task\.seq_len\); allowed: "
     r"at least 256 tokens$"),
    ({"chinchilla": [1e-5]}, {}, r"budget\.chinchilla: 1e-05 x 20 x 1,149,248 \(all "
     r"parameters\) = 230 tokens is less than one optimizer step of 256 tokens"),
    ({"tokens": [1000], "chinchilla": [1]}, {}, r"^budget: give tokens or chinchilla, not both"),
    ({"tokens": []}, {}, r"^budget\.tokens: an empty list \(allowed: a list of token counts"),
    ({"chinchilla": []}, {}, r"^budget\.chinchilla: an empty list \(allowed: a list of "),
    ({"tokens": [0]}, {}, r"^budget\.tokens\.0: 0 is invalid \(Input should be greater than or "
     r"equal to 1\)$"),
    ({"chinchilla": [2, float("nan")]}, {}, r"^budget\.chinchilla\.1: nan is invalid \(Input "
     r"should be a finite number\)$"),
    ({"tokens": [512, 512]}, {}, r"^budget\.tokens: 512 is listed twice"),
    ({"tokens": [512], "params": "all"}, {}, r"^budget\.params: counts parameters for "
     r"chinchilla budgets only"),
    ({"tokens": [512]}, {"train": {"steps": 5}}, r"^train\.steps: budget sets each trial's "
     r"steps \(tokens / tokens per step\); remove train\.steps \(allowed with budget: neither "),
    ({"tokens": [512]}, {"search": {"space": {"train.steps": [5, 10]}}},
     r"^search\.space\.train\.steps: budget sets each trial's steps"),
    ({"tokens": [512]}, {"methods": {"full": {"space": {"train.steps": [5]}}}},
     r"^methods\.full\.space\.train\.steps: budget sets each trial's steps"),
    ({"tokens": [512]}, {"methods": {"full": {"train": {"warmup_steps": 5}}}},
     r"^methods\.full\.train\.warmup_steps: budget sets each trial's warmup \(budget\.warmup\)"),
    ({"tokens": [512]}, {"train": {"epochs": 3}}, r"^train\.epochs: a budget counts tokens, "
     r"and epochs \(GLUE\) count passes over a training set \(allowed: one of them"),
    ({"tokens": [512]}, {"task": {"kind": "glue"}}, r"^budget: counts pretraining tokens, and "
     r"task\.kind is glue"),
    ({"tokens": [512]}, {"search": {"sampler": "tpe", "n_trials": 4}},
     r"^budget with search\.sampler tpe: an Optuna study per method would mix the budgets"),
])
def test_each_bad_budget_is_one_line_naming_the_key(tmp_path, budget, more, line):
    path = budget_sweep(tmp_path, budget, **more)
    with pytest.raises(UserError, match=line):
        expand(load_sweep(path, {}))


def test_a_budget_refuses_steps_set_on_the_command_line(tmp_path):
    path = budget_sweep(tmp_path, {"tokens": [512]})
    with pytest.raises(UserError, match=r"^train\.steps: budget sets each trial's steps"):
        load_sweep(path, {"train.steps": 4})
