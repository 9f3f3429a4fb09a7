"""The papers' recipes (analysis/paper/settings.csv) and the flag a comparison carries when our
trials ran otherwise: empty at the paper's settings, each differing setting named, settings a
trial does not record said to be unknown, and the flag shown by the report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from harness.analysis import load_runs, write_report
from harness.analysis.paper import compare_glue, compare_pretrain, compare_throughput, load_paper
from harness.analysis.recipe import departures, recipe
from harness.config import MemoryConfig, TaskConfig, TrainConfig
from harness.methods.base import get_method, method_names
from harness.methods.resolve import load_run

TABLE2 = "GaLore (Zhao et al. 2024; arXiv:2403.03507v2) Table 2"
RELORA = "ReLoRA (Lialin et al. 2024): perplexity, pretraining on C4"
# GaLore Table 2's recipe at 60M (App. C.1, §5.1, scripts/benchmark_c4/llama_60m.sh).
PAPER_60M = {
    "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 256},
    "train": {"steps": 10_000, "warmup_steps": 1000, "batch_size": 128, "total_batch_size": 512,
              "precision": "bf16-true", "grad_clip": None, "weight_decay": 0.0,
              "schedule": "cosine", "min_lr_ratio": 0.1},
}
GALORE = {"name": "galore", "rank": 128, "update_proj_gap": 200, "scale": 0.25}


def resolved(method: dict[str, Any], lr: float, *, model: str = "llama_60m",
             **sections: dict[str, Any]) -> dict[str, Any]:
    """The config a trial of PAPER_60M (sections overridden) writes: resolved, defaults in."""
    data: dict[str, Any] = {"name": "c4_60m", "model": model, "method": method}
    for key, section in PAPER_60M.items():
        data[key] = {**section, **sections.get(key, {})}
    data["train"]["lr"] = lr
    return load_run(data).model_dump(mode="json", by_alias=True)


def write_trial(root: Path, trial: str, config: dict[str, Any], ppl: float | None,
                drop: tuple[str, ...] = (), **results: float) -> None:
    """A finished trial as the trainer leaves it; `drop` removes dotted keys from its config,
    as a run from before those keys existed has them missing."""
    for key in drop:
        section, name = key.split(".")
        config[section].pop(name, None)
    folder = root / "trials" / trial
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "label": trial}))
    train = config["train"]
    summary = {"trial": trial, "status": "ok", "method": trial, "lr": train["lr"], "seed": 0,
               "method_name": config["method"]["name"], "model": config["model"],
               "steps": train.get("steps"), "eval_ppl": ppl, "tokens_per_s": 1000.0,
               "peak_memory_bytes": 1e9, **results}
    (folder / "summary.json").write_text(json.dumps(summary))
    line = {"kind": "eval", "step": train.get("steps"), "tokens": 1, "eval_ppl": ppl}
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")


def row(compared: pd.DataFrame, method: str, source: str) -> pd.Series:
    return compared[(compared["method"] == method) & (compared["source"] == source)].iloc[0]


def test_a_sweep_at_the_papers_recipe_shows_no_difference(tmp_path: Path) -> None:
    write_trial(tmp_path, "galore", resolved(GALORE, 0.01), 35.0)
    write_trial(tmp_path, "full", resolved({"name": "full"}, 1e-3), 34.0)
    compared = compare_pretrain(load_runs(tmp_path))
    for method in ("galore", "full"):
        assert row(compared, method, TABLE2)[["differs", "unknown"]].tolist() == ["", ""]
    # ReLoRA's own table ran its code's defaults: 512 tokens a sequence, clipping at 1.
    relora = row(compared, "full", RELORA)
    assert (relora["differs"], relora["unknown"]) == (
        "task.seq_len 256≠512; train.grad_clip none≠1", "")


def test_other_steps_rank_and_betas_are_listed_exactly(tmp_path: Path) -> None:
    method = {**GALORE, "rank": 8, "betas": [0.9, 0.95]}
    write_trial(tmp_path, "galore", resolved(method, 0.01, train={"steps": 20_000}), 40.0)
    found = row(compare_pretrain(load_runs(tmp_path)), "galore", TABLE2)
    assert set(found["differs"].split("; ")) == {
        "method.rank 8≠128", "train.steps 20000≠10000", "method.betas (0.9, 0.95)≠(0.9, 0.999)"}
    assert found["unknown"] == ""


def test_settings_a_trial_does_not_record_are_unknown(tmp_path: Path) -> None:
    qgalore = {"name": "qgalore", "rank": 128, "betas": [0.9, 0.95]}
    config = resolved(qgalore, 0.015, train={"precision": "bf16-mixed"})
    write_trial(tmp_path, "qgalore", config, 35.0,
                drop=("method.lazy_schedule", "method.queue_size", "train.weight_decay"))
    found = compare_pretrain(load_runs(tmp_path)).iloc[0]
    assert found["source"] == "Q-GaLore (Zhang et al. 2024) Table 1"
    assert found["differs"] == "train.precision bf16-mixed≠bf16-true"
    assert set(found["unknown"].split("; ")) == {
        "train.weight_decay (paper: 0)", "method.queue_size (paper: 5)",
        "method.lazy_schedule (paper: reference)"}


APOLLO2 = "APOLLO (Zhu et al. 2024; arXiv:2412.05270) Table 2"
# APOLLO's and Fira's 60M scripts (zhuhanqing/APOLLO@76b3472, xichen-fy/Fira@5c28b13).
APOLLO = {"name": "apollo", "rank": 128, "scale": 1.0, "update_proj_gap": 200, "eps": 1e-6}
APOLLO_MINI = {"name": "apollo_mini", "scale": 128.0, "update_proj_gap": 200, "eps": 1e-6}
FIRA = {"name": "fira", "rank": 128, "scale": 0.25, "update_proj_gap": 200, "eps": 1e-6}


def test_apollo_and_fira_trials_meet_their_own_rows_and_are_flagged(tmp_path: Path) -> None:
    write_trial(tmp_path, "apollo", resolved(APOLLO, 0.01), 31.0)
    write_trial(tmp_path, "apollo_mini", resolved({**APOLLO_MINI, "scale": 64.0}, 0.01), 32.0)
    write_trial(tmp_path, "fira", resolved({**FIRA, "optimizer": "adam8bit"}, 0.005), 31.5)
    compared = compare_pretrain(load_runs(tmp_path)).set_index("method")
    assert compared.loc["apollo", ["paper", "source", "differs", "unknown"]].tolist() == [
        31.55, APOLLO2 + "; memory: as GaLore's (BF16 weights + optimizer states)", "", ""]
    mini = compared.loc["apollo_mini"]
    assert (mini["paper"], mini["differs"]) == (31.93, "method.scale 64≠128")
    fira = compared.loc["fira"]
    assert fira["paper"] == 31.06 and fira["source"].startswith("Fira (Chen et al. 2024")
    assert set(fira["differs"].split("; ")) == {"train.lr 0.005≠0.01",
                                                "method.optimizer adam8bit≠adamw"}
    # One row each: no method meets another's published number.
    assert compared.index.value_counts().to_dict() == {"apollo": 1, "apollo_mini": 1, "fira": 1}


def test_apollo_at_7b_meets_table_3_at_its_steps_and_adam_mini_meets_nothing(
        tmp_path: Path) -> None:
    seven = {"steps": 150_000, "warmup_steps": 15_000, "grad_clip": None}
    write_trial(tmp_path, "apollo", resolved({**APOLLO, "rank": 256}, 0.01, model="llama_7b",
                                             train=seven), 13.5)
    # Adam-mini's Llama-2 number ran its own setup: "Llama-2 1B", which no preset is.
    recipe_1b = {"steps": 200_000, "warmup_steps": 2000, "weight_decay": 0.1}
    write_trial(tmp_path, "adam_mini", resolved({"name": "adam_mini", "betas": [0.9, 0.95]},
                                                2e-4, model="llama_1b", train=recipe_1b), 12.0)
    compared = compare_pretrain(load_runs(tmp_path))
    assert compared[["method", "setting", "paper", "differs"]].values.tolist() == [
        ["apollo", "7B, 150K steps", 13.02, ""]]
    assert set(load_paper("adam_mini_table")["model"]) == {"Llama-2 1B"}


def test_departures_read_keys_that_exist_only_in_newer_runs() -> None:
    wanted = {"method.lazy_schedule": ("reference", "s"), "train.grad_clip": ("none", "s"),
              "method.warm_start_steps": (">0", "s")}
    newer = pd.DataFrame({"method.lazy_schedule": ["ours"], "train.grad_clip": [None],
                          "method.warm_start_steps": [0]})
    assert departures(newer, wanted) == (
        "method.lazy_schedule ours≠reference; method.warm_start_steps 0≠>0", "")
    older = pd.DataFrame({"train.grad_clip": [1.0], "method.warm_start_steps": [1000]})
    assert departures(older, wanted) == (
        "train.grad_clip 1≠none", "method.lazy_schedule (paper: reference)")
    # A null elsewhere is no value: a trial that does not record the key.
    unset = pd.DataFrame({"method.lazy_schedule": [None], "train.grad_clip": [math.nan],
                          "method.warm_start_steps": [2]})
    assert departures(unset, wanted) == ("", "method.lazy_schedule (paper: reference)")


def test_several_trials_of_one_pick_show_each_value(tmp_path: Path) -> None:
    trials = pd.DataFrame({"method.rank": [128, 64]})
    assert departures(trials, {"method.rank": ("128", "s")}) == ("method.rank 128/64≠128", "")


def test_glue_and_throughput_rows_use_their_tables_recipes(tmp_path: Path) -> None:
    glue = {"model": "roberta-base", "method": {"name": "galore", "rank": 8, "scale": 2.0},
            "task": {"kind": "glue", "glue_task": "sst2", "seq_len": 512},
            "train": {"lr": 2e-5, "epochs": 30, "batch_size": 16, "total_batch_size": None}}
    write_trial(tmp_path, "galore_r8", glue, None, best_eval_score=94.0)
    throughput = resolved({"name": "full"}, 1e-3, model="llama_1b",
                          train={"batch_size": 1, "total_batch_size": 1})
    write_trial(tmp_path, "full", throughput, 16.0)
    trials = load_runs(tmp_path)
    assert compare_glue(trials)[["setting", "differs", "unknown"]].values.tolist() == [
        ["SST-2", "", ""]]
    speed = compare_throughput(trials)
    assert set(speed["differs"]) == {""} and set(speed["unknown"]) == {""}
    assert recipe("galore_table11", "AdamW", "1B")["tokens_per_step"][0] == "256"


def test_report_flags_a_mismatched_comparison_in_markdown_and_html(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write_trial(runs, "galore", resolved({**GALORE, "rank": 8}, 0.01), 40.0)
    write_report(runs, tmp_path / "report")
    markdown = (tmp_path / "report" / "report.md").read_text()
    html = (tmp_path / "report" / "report.html").read_text()
    flag = "Not like for like: 1 of 1 comparisons ran with settings that differ"
    assert flag in markdown and "method.rank 8≠128" in markdown
    assert flag in html and '<td class="flag">method.rank 8≠128' in html
    assert "<td class=\"flag\"></td>" not in html
    assert (tmp_path / "report" / "paper_pretrain.md").read_text().count(flag) == 1


def test_every_recorded_setting_is_a_config_key_of_a_published_row_with_a_source() -> None:
    settings = load_paper("settings")
    methods = {f for name in method_names() for f in get_method(name).Config.model_fields}
    fields = {"train": TrainConfig.model_fields, "task": TaskConfig.model_fields,
              "memory": MemoryConfig.model_fields, "method": methods}
    for entry in settings.itertuples(index=False):
        assert entry.source.strip(), entry
        if entry.key != "tokens_per_step":
            section, name = entry.key.split(".")
            assert name in fields[section], entry.key
        paper = load_paper(entry.table)
        assert entry.method == "*" or entry.method in set(paper["method"]), entry
        columns = set(paper.get("model", paper.get("task")))
        assert entry.model == "*" or entry.model in columns, entry
    # One record per key and place: two would make a comparison depend on file order.
    assert not settings.duplicated(["table", "method", "model", "rank", "key"]).any()


@pytest.mark.parametrize(("table", "method", "model", "key", "value"), [
    ("galore_table2", "GaLore", "1B", "method.rank", "512"),  # Table 2 r/d_model row
    ("galore_table2", "LoRA", "60M", "method.dropout", "0.05"),  # §5.1
    ("galore_table3", "8-bit GaLore", "7B", "train.steps", "150000"),  # §5.3
    ("qgalore_table1", "Q-GaLore", "7B", "method.clip_int8", "false"),
    ("qgalore_table1", "Q-GaLore", "60M", "method.betas", "(0.9, 0.95)"),
    ("relora_table", "ReLoRA", "130M", "method.warm_start", "reference"),
    ("relora_table", "ReLoRA", "130M", "method.prune", "random"),
    ("apollo_table2", "APOLLO", "130M", "method.rank", "192"),  # llama_130m_apollo.sh
    ("apollo_table2", "APOLLO-Mini", "130M", "method.scale", "192"),
    ("apollo_table2", "APOLLO-Mini", "1B", "method.limiter", "true"),  # apollo.py disable_nl
    ("apollo_table3", "APOLLO-Mini", "7B", "method.scale", "128"),
    ("fira_table3", "Fira", "1B", "method.scale", "0.0625"),  # Fira's llama_1b.sh --alpha
    ("adam_mini_table", "Adam-mini", "Llama-2 1B", "method.betas", "(0.9, 0.95)"),
])
def test_recipes_hold_the_sources_values(table: str, method: str, model: str, key: str,
                                         value: str) -> None:
    assert recipe(table, method, model)[key][0] == value
