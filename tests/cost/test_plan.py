"""`harness plan`: what fits a memory budget, from the estimator alone (nothing trains)."""

from __future__ import annotations

import json

import pytest
from conftest import harness

from harness.cli import main
from harness.cost import plan as pl
from harness.cost.estimate import estimate_run
from harness.errors import UserError


@pytest.fixture(scope="module")
def micro_plan() -> pl.Plan:
    """A budget (34 MB) some configurations fit (peaks here run from 27 to 42 MB)."""
    return pl.plan("llama_micro", int(34e6), seq_len=64, token_batch=256, tokenizer="sample")


@pytest.mark.parametrize(("text", "expected"), [
    ("24GB", 24 * 10**9), ("24 GB", 24 * 10**9), ("24gb", 24 * 10**9), ("24GiB", 24 * 2**30),
    ("16000MB", 16 * 10**9), ("1.5 GB", 1_500_000_000), ("512MiB", 512 * 2**20),
])  # fmt: skip
def test_parse_memory(text: str, expected: int) -> None:
    assert pl.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["24", "24XB", "-1GB", "GB", "0GB", "24 G B", ""])
def test_parse_memory_refuses(text: str) -> None:
    with pytest.raises(UserError, match="is not a memory size"):
        pl.parse_memory(text)


def test_every_listed_config_fits_sorted_by_cost(micro_plan: pl.Plan) -> None:
    assert micro_plan.fits and not micro_plan.closest
    assert any(c.accumulation > 1 for c in micro_plan.fits)
    assert all(c.fits and c.peak_bytes <= micro_plan.budget for c in micro_plan.fits)
    costs = [round(c.cost, 4) for c in micro_plan.fits]
    assert costs == sorted(costs)
    assert {c.precision for c in micro_plan.fits} == set(pl.PRECISIONS)
    assert {"recompute full", "layerwise", "optimizer host"} <= {
        part for c in micro_plan.fits for part in c.modifiers.replace(" + ", ", ").split(", ")}


def test_peak_is_the_estimators(micro_plan: pl.Plan) -> None:
    """The same estimator as `harness estimate`; under host offload minus the states it moves."""
    for c in micro_plan.fits[:: max(1, len(micro_plan.fits) // 25)]:
        record = estimate_run(pl.run_of(c, "llama_micro", 64, "sample"))
        host = c.memory.get("optimizer_offload") == "host"
        assert c.peak_bytes == record["peak_bytes"] - host * record["optimizer_state_bytes"]


def test_refused_combinations_never_appear(micro_plan: pl.Plan) -> None:
    listed = {(c.label, c.modifiers) for c in micro_plan.fits}
    assert not [m for label, m in listed if label == "relora" and "layerwise" in m]
    assert not [m for label, m in listed if label == "qgalore" and "optimizer host" in m]
    why = micro_plan.refused["relora [layerwise] bf16-mixed"]
    assert why.startswith("method relora: ") and "layerwise" in why


def test_costs_follow_the_model() -> None:
    everything = pl.plan("llama_micro", 10**9, seq_len=64, token_batch=256, tokenizer="sample")
    rows = {(c.label, c.modifiers, c.precision): c for c in everything.fits}
    base = rows[("full", "", "bf16-mixed")]
    assert base.cost == pytest.approx(1.0)
    assert rows[("full", "", "bf16-true")].cost == pytest.approx(1.0)
    assert rows[("full", "", "32-true")].cost > 1  # fp32 matmuls run slower
    full = rows[("full", "recompute full", "bf16-mixed")]
    assert 0 < full.recompute_forwards < 1 and full.cost > base.cost  # the head is not redone
    offload = rows[("full", "optimizer host", "bf16-mixed")]
    assert offload.transfer_bytes > 0 and offload.cost > base.cost


def test_accumulation_when_a_whole_batch_does_not_fit() -> None:
    whole = pl.plan("llama_micro", 10**12, seq_len=64, token_batch=512, tokenizer="sample")
    assert all(c.accumulation == 1 for c in whole.fits)
    key = ("full", "", "bf16-mixed")
    whole_peak = next(c.peak_bytes for c in whole.fits
                      if (c.label, c.modifiers, c.precision) == key)  # fmt: skip
    split_run = pl.run_of(pl.Candidate("full", "full", {}, "", {}, "bf16-mixed", 2, 4),
                          "llama_micro", 64, "sample")  # fmt: skip
    budget = estimate_run(split_run)["peak_bytes"]
    assert budget < whole_peak
    split = pl.plan("llama_micro", budget, seq_len=64, token_batch=512, tokenizer="sample")
    row = next(c for c in split.fits if (c.label, c.modifiers, c.precision) == key)
    assert (row.micro_batch, row.accumulation) == (2, 4)  # the largest micro-batch that fits
    assert row.cost > 1 and "4 micro-batches" in pl.format_plan(split, "llama_micro", 0)


def test_a_budget_nothing_fits_shows_the_closest() -> None:
    p = pl.plan("llama_micro", 1000, seq_len=64, token_batch=64, tokenizer="sample")
    assert not p.fits and len(p.closest) == 5
    peaks = [c.peak_bytes for c in p.closest]
    assert peaks == sorted(peaks) and peaks[0] > 1000
    text = pl.format_plan(p, "llama_micro")
    assert text.startswith("nothing fits llama_micro in 1.0 kB; the 5 closest by peak:")


def test_measured_tok_s_from_galore_table_11() -> None:
    rows = [pl.Candidate("full", "full", {}, "", {}, "bf16-true", 1, 1),
            pl.Candidate("galore_8bit", "galore", {}, "layerwise", {}, "bf16-true", 1, 1),
            pl.Candidate("full", "full", {}, "recompute full", {}, "bf16-true", 1, 1)]
    pl._measured(rows, "llama_1b", 256, 256)
    assert [c.tok_s for c in rows] == [1256.98, 1019.63, None]
    pl._measured(rows[:1], "llama_1b", 256, 512)  # another token batch: not that measurement
    other = pl.Candidate("full", "full", {}, "", {}, "bf16-true", 2, 1)
    pl._measured([other], "llama_1b", 256, 512)
    assert other.tok_s is None


def test_cli_bad_memory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama_micro", "--memory", "24XB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --memory: '24XB' is not a memory size") and err.count("\n") == 1
    assert main(["plan", "llama_micro", "--memory", "1GB", "--token-batch", "100"]) == 2
    assert "not a whole number of sequences" in capsys.readouterr().err
    assert main(["plan", "llama_huge", "--memory", "1GB"]) == 2
    assert main(["plan", "llama_micro", "--memory", "1GB", "--seq-len", "1", "--token-batch",
                 "4"]) == 2  # every candidate refused for the same reason: that reason
    assert capsys.readouterr().err.count("\n") == 2  # llama_huge's line and this one


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama_micro", "--memory", "1GB", "--seq-len", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget_bytes"] == 10**9 and data["fits"] and data["closest"] == []
    assert {"label", "modifiers", "precision", "micro_batch", "accumulation", "peak_bytes",
            "cost", "tok_s", "breakdown"} <= set(data["fits"][0])  # fmt: skip


def test_llama_7b_in_24gb() -> None:
    """The issue's question, as a user types it."""
    out = harness("plan", "llama_7b", "--memory", "24GB")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "configurations of llama_7b fit in 24.00 GB" in lines[0]
    assert lines[3].split()[0] == "1"
    assert float(lines[3].split(" GB")[0].split()[-1]) <= 24
