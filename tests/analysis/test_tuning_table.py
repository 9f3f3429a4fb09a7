"""The report's tuning table (analysis/tuning.py) on synthetic trials: each method's tuned
values, its trial count, the loss at 0.5x and 2x its best LR and its diverged trials; every
expected cell worked out by hand."""

from __future__ import annotations

import math

import pandas as pd

from harness.analysis.tuning import tuning_section, tuning_table

ADAMW_999, ADAMW_95 = "[0.9, 0.999]", [0.9, 0.95]  # load_runs gives a list setting as text


def trial(method: str, lr: float, loss: float, status: str = "ok", seed: int = 0,
          **settings) -> dict:
    name = {"adamw": "full"}.get(method, method)
    return {"model": "llama_tiny", "method": method, "method_name": name, "lr": lr,
            "seed": seed, "status": status, "eval_loss": loss, "tokens": 1_000_000,
            **{f"method.{k}": v for k, v in settings.items()}}


def frame() -> pd.DataFrame:
    """AdamW: best at lr 2e-3 with betas (0.9, 0.999), losses 2.8 and 3.0; at 1e-3 3.0 and 3.2;
    at 4e-3 one seed diverged (nan) and one 3.5; betas (0.9, 0.95) at 2e-3 worse (3.3).
    Muon: one LR only, its other seed diverged to an infinite loss."""
    rows = [trial("adamw", 1e-3, 3.0, betas=ADAMW_999), trial("adamw", 1e-3, 3.2, seed=1,
                                                                betas=ADAMW_999),
            trial("adamw", 2e-3, 2.8, betas=ADAMW_999), trial("adamw", 2e-3, 3.0, seed=1,
                                                                betas=ADAMW_999),
            trial("adamw", 4e-3, math.nan, "nan", betas=ADAMW_999),
            trial("adamw", 4e-3, 3.5, seed=1, betas=ADAMW_999),
            trial("adamw", 2e-3, 3.3, betas=ADAMW_95),
            trial("muon", 1e-2, 3.1, momentum=0.95),
            trial("muon", 1e-2, math.inf, seed=1, momentum=0.95)]
    return pd.DataFrame(rows)


def test_each_methods_tuned_values_trials_sensitivity_and_divergences():
    """t(0.975, 1) = 12.706; two seeds 0.2 apart: sd 0.1414, half-width 12.706 x 0.1 = 1.27."""
    table = tuning_table(frame()).set_index("method")
    adamw = table.loc["adamw"]
    assert adamw["tuned"] == "lr=0.002, betas=(0.9, 0.999)"
    assert (adamw["configurations"], adamw["trials"], adamw["diverged"]) == (4, 7, 1)
    assert adamw["best"] == "2.90 ± 1.27 (n=2)"
    assert adamw["at 0.5x lr"] == "3.10 ± 1.27 (n=2)"
    assert adamw["at 2x lr"] == "3.50"  # its nan seed left out, counted as diverged
    muon = table.loc["muon"]
    assert (muon["tuned"], muon["best"], muon["diverged"]) == ("lr=0.01, momentum=0.95", "3.10", 1)
    assert (muon["at 0.5x lr"], muon["at 2x lr"]) == ("not run", "not run")
    assert (adamw["model"], adamw["budget"]) == ("llama_tiny", "1,000,000 tokens")


def test_a_lr_whose_trials_all_diverged_says_so():
    rows = [trial("adamw", 1e-3, 3.0, betas=ADAMW_999),
            trial("adamw", 2e-3, math.nan, "nan", betas=ADAMW_999)]
    row = tuning_table(pd.DataFrame(rows)).iloc[0]
    assert (row["at 2x lr"], row["at 0.5x lr"], row["diverged"]) == ("diverged", "not run", 1)


def test_budgets_are_rows_apart():
    """The same method at two token budgets: a row each, each tuned on its own trials."""
    rows = [{**trial("adamw", 1e-3, 3.0, betas=ADAMW_999), "budget_tokens": 2_000_000},
            {**trial("adamw", 2e-3, 2.0, betas=ADAMW_999), "budget_tokens": 4_000_000}]
    table = tuning_table(pd.DataFrame(rows))
    assert list(table["budget"]) == ["2,000,000 tokens", "4,000,000 tokens"]
    assert list(table["tuned"]) == ["lr=0.001, betas=(0.9, 0.999)", "lr=0.002, betas=(0.9, 0.999)"]


def test_the_section_is_left_out_without_tuning_and_says_when_nothing_finished():
    assert tuning_section(frame(), {"name": "x"}) == ([], [])
    empty = frame().assign(status="failed")
    _, text = tuning_section(empty, {"tuning": {"procedure": "coordinate"}})
    assert "no trial finished" in text[0]


def test_rows_go_by_method_as_they_came_then_budgets_rising():
    """Trials in the order a coordinate sweep finishes them: budgets interleaved."""
    rows = [{**trial(m, 1e-3, 3.0), "budget_tokens": b}
            for m, b in [("muon", 4_000_000), ("adamw", 1_000_000), ("muon", 1_000_000),
                         ("adamw", 4_000_000), ("adamw", 2_000_000)]]
    table = tuning_table(pd.DataFrame(rows))
    assert list(zip(table["method"], table["budget"], strict=True)) == [
        ("muon", "1,000,000 tokens"), ("muon", "4,000,000 tokens"),
        ("adamw", "1,000,000 tokens"), ("adamw", "2,000,000 tokens"),
        ("adamw", "4,000,000 tokens")]
