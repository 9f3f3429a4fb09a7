"""The report's speedup and scaling sections on run folders written by hand: the tables and
figures where the sweep has the budgets and sizes a fit needs, one line each where not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import yaml

from harness.analysis import write_report

MODELS = {"llama_micro": 2e6, "llama_tiny": 7.36e6}


def _write_trial(root: Path, trial: str, method: str, model: str, tokens: float,
                 loss: float) -> None:
    folder = root / "trials" / trial
    folder.mkdir(parents=True)
    config = {"name": "budgets", "seed": 0, "model": model, "label": method,
              "method": {"name": method}, "train": {"lr": 0.001, "steps": int(tokens / 1024)},
              "task": {"kind": "pretrain", "dataset": "sample", "seq_len": 128}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    summary = {"trial": trial, "status": "ok", "method": method, "method_name": method,
               "lr": 0.001, "seed": 0, "model": model, "steps": tokens / 1024,
               "step": tokens / 1024, "tokens": tokens, "eval_loss": loss,
               "eval_ppl": math.exp(loss), "total_params": MODELS[model],
               "peak_memory_bytes": 1e8, "device": "cpu"}
    (folder / "summary.json").write_text(json.dumps(summary))
    line = {"kind": "eval", "step": tokens / 1024, "tokens": tokens, "eval_loss": loss,
            "eval_ppl": math.exp(loss)}
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")


def _runs(root: Path, budgets: tuple[float, ...]) -> Path:
    """AdamW on L = E + 1000·D^−0.5 (E 2 on the small model, 1.8 on the larger); `galore`
    reaching at D what AdamW reaches at D/2 (speedup 0.5)."""
    root.mkdir(parents=True)
    (root / "sweep.yaml").write_text(yaml.safe_dump({"name": "budgets",
                                                     "methods": {"full": {}, "galore": {}}}))
    for i, (model, floor) in enumerate(zip(MODELS, (2.0, 1.8), strict=True)):
        for j, tokens in enumerate(budgets):
            _write_trial(root, f"f{i}{j}", "full", model, tokens, floor + 1000 / tokens**0.5)
            _write_trial(root, f"g{i}{j}", "galore", model, tokens,
                         floor + 1000 / (tokens / 2) ** 0.5)
    return root


def test_the_report_has_the_speedup_and_scaling_sections(tmp_path: Path) -> None:
    runs = _runs(tmp_path / "runs", (1e6, 2e6, 4e6))
    printed = write_report(runs)
    report = runs / "report"
    page = (report / "report.md").read_text()
    assert "## Speedup over tuned AdamW" in page and "![" in page
    assert "## Scaling across model sizes" in page
    assert (report / "speedup.png").stat().st_size > 0
    assert (report / "scaling.png").stat().st_size > 0
    table = pd.read_csv(report / "speedup.csv", dtype=str).set_index(["model", "method",
                                                                        "tokens"])
    assert table.loc[("llama_tiny", "galore", "2,000,000"), "speedup"] == "0.50"
    assert table.loc[("llama_micro", "full", "4,000,000"), "speedup"] == "1.00"
    assert "llama_micro: AdamW (`full`) L(D) = 2 + " in page
    scaling = pd.read_csv(report / "scaling.csv", dtype=str).set_index("method")
    assert scaling.loc["galore", "sizes"] == "llama_micro (2M), llama_tiny (7.36M)"
    assert "Speedup over tuned AdamW\n" in printed


def test_a_sweep_without_budgets_gets_a_line_instead(tmp_path: Path) -> None:
    runs = _runs(tmp_path / "runs", (1e6,))
    printed = write_report(runs)
    report = runs / "report"
    page = (report / "report.md").read_text()
    line = ("Speedup over tuned AdamW: not computed. llama_micro: no speedup: AdamW (`full`) "
            "finished at 1 token budget(s) (1,000,000); its fit L(D) = E + A·D^−α needs 3.")
    assert line in page and line in printed
    assert not (report / "speedup.csv").exists() and not (report / "speedup.png").exists()
    assert "## Speedup over tuned AdamW" not in page
    assert "## Scaling across model sizes" in page  # two sizes: a law without floor each
