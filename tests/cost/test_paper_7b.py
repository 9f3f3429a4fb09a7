"""`harness estimate sweeps/c4_7b_paper.yaml`: the published LLaMA-7B single-device figures
(GaLore §1 / Fig. 1 and §5.5, Q-GaLore's script for the same setting) from a documented
accounting under bf16-true, and the bytes per parameter that accounting rests on."""

from __future__ import annotations

import pytest

from harness.bench.memory import method_run
from harness.cost import estimate as est
from harness.cost.paper_7b import PAPER_7B, TOLERANCE, comparison_7b, parts_bytes
from harness.methods import build_memory
from harness.models import param_shapes
from harness.sweep.plan.expand import estimate_sweep, expand, load_sweep

SWEEP = "sweeps/c4_7b_paper.yaml"
ROWS = {"full": "BF16 AdamW", "adam8bit": "8-bit Adam",
        "galore_8bit_layerwise": "8-bit GaLore layer-wise", "qgalore": "Q-GaLore"}


@pytest.fixture(scope="module")
def records():
    return {r["method"]: r for r in estimate_sweep(load_sweep(SWEEP, {}))}


@pytest.mark.parametrize("label", ["full", "adam8bit", "galore_8bit_layerwise"])
def test_the_papers_7b_figures_are_reached_within_10_percent(records, label):
    paper = PAPER_7B[ROWS[label]][0] * 1e9
    assert abs(parts_bytes(records[label]) / paper - 1) <= TOLERANCE


def test_bf16_adamw_splits_as_the_paper_does_but_for_the_activations(records):
    """14 GB weights and 42 GB gradients and Adam states; activations (2 GB in the paper, which
    GaLore#57 could not reproduce) come out at 1.6 GB: docs/estimate.md."""
    r = records["full"]
    assert abs(r["weight_bytes"] / 14e9 - 1) <= TOLERANCE
    assert abs((r["grad_bytes"] + r["optimizer_state_bytes"]) / 42e9 - 1) <= TOLERANCE
    assert 1.4e9 < r["activation_bytes"] < 2e9
    # the peak: gradients and activations are never all alive at once
    workspaces = 2 * 32 * 2**20  # torch's two cuBLAS workspaces on a CUDA device
    assert r["peak_bytes"] - workspaces == r["total_bytes"] < parts_bytes(r)


def test_8bit_galore_saves_what_the_paper_says_against_8bit_adam(records):
    """§5.5: 9.6 GB of optimizer state and 13.5 GB of gradients."""
    adam, galore = records["adam8bit"], records["galore_8bit_layerwise"]
    saved_states = adam["optimizer_state_bytes"] - galore["optimizer_state_bytes"]
    saved_grads = adam["grad_bytes"] - galore["grad_bytes"]
    assert abs(saved_states / 9.6e9 - 1) <= TOLERANCE
    assert abs(saved_grads / 13.5e9 - 1) <= TOLERANCE


def test_q_galore_weights_and_gradient_are_the_bytes_counted_by_hand(records):
    """LLaMA-7B with t5-base's 32,100 entries, from the preset: a layer's q, k, v, o
    4 x 4096^2 = 67,108,864 and gate, up, down 3 x 11008 x 4096 = 135,266,304, x 32 layers =
    6,476,005,376 INT8 codes, 1 byte each; embedding and head 2 x 32100 x 4096 = 262,963,200
    and 65 norms x 4096 = 266,240 in bfloat16, 2 bytes each. Layer-wise, one gradient at a
    time: the largest, the embedding's (or the head's) 131,481,600 in bfloat16."""
    r = records["qgalore"]
    assert r["weight_bytes"] == 6_476_005_376 + 2 * (262_963_200 + 266_240)  # 7.00 GB
    assert r["grad_bytes"] == 2 * 32_100 * 4096


def qgalore_ratio(records) -> float:
    return parts_bytes(records["qgalore"]) / (PAPER_7B["Q-GaLore"][0] * 1e9)


def test_q_galore_is_no_further_below_its_published_figure_than_documented(records):
    """The sum of the tensors Q-GaLore keeps, 13.34 GB, is 11.5% below the 15.08 G its script
    states (docs/estimate.md: what the gap could be is not in the shapes). Bounded on both
    sides of 'better': a term lost (further below 0.88) or overshooting the paper by more
    than the 10% allowed to the other rows fails; closing the gap passes here and turns the
    strict xfail below into a failure that says to remove it."""
    assert 0.88 < qgalore_ratio(records) <= 1 + TOLERANCE  # 13.34 / 15.08 = 0.885 today


@pytest.mark.xfail(strict=True, reason="known miss, docs/estimate.md: 13.34 GB against Q-GaLore's "
                   "15.08 G (-11.5%); when the estimate comes within 10%, remove this mark")
def test_q_galore_is_within_10_percent_of_its_published_figure(records):
    """The target every other row meets. Written as the expectation, not as a pass at the
    current gap: a strict xfail fails the suite as soon as the estimate reaches it."""
    assert abs(qgalore_ratio(records) - 1) <= TOLERANCE


def test_the_comparison_prints_every_row_and_flags_what_is_more_than_10_percent_off(records):
    """Each row's diff cells carry '!' exactly when that figure is more than 10% from the
    paper's: checked against the row's own bytes, so it holds whichever rows miss."""
    text = comparison_7b(list(records.values()), load_sweep(SWEEP, {}))
    lines = {line.split()[0]: line for line in text.splitlines()[2:] if line.split()}
    assert set(ROWS) <= set(lines)
    for label, row in ROWS.items():
        paper = PAPER_7B[row][0] * 1e9
        off = [abs(ours / paper - 1) > TOLERANCE
               for ours in (parts_bytes(records[label]), records[label]["peak_bytes"])]
        assert lines[label].count("!") == sum(off), lines[label]
    assert "!" not in lines["full"]  # -4.2% summed, -7.0% as a peak
    assert max(map(len, text.splitlines())) <= 120  # a terminal's width, as the estimate's table
    assert f"  Q-GaLore: {PAPER_7B['Q-GaLore'][1]}" in text.splitlines()  # each source below
    points = {t.id: (t.run.train.lr, t.point) for t in expand(load_sweep(SWEEP, {}))}
    assert "activations" in est.format_table(list(records.values()), points)


def test_the_comparison_is_left_out_off_the_papers_setting():
    sweep = load_sweep(SWEEP, {"train.precision": "bf16-mixed", "train.state_dtype": "float32"})
    assert comparison_7b(estimate_sweep(sweep), sweep) == ""


def test_a_method_s_own_train_keys_win_over_the_sweep_s():
    runs = {t.label: t.run for t in expand(load_sweep(SWEEP, {}))}
    assert runs["adam8bit"].train.state_dtype == "float32"  # bitsandbytes' small-tensor states
    assert {runs[k].train.state_dtype for k in ("full", "qgalore")} == {"bfloat16"}


@pytest.mark.parametrize("overrides, states_per_param", [
    ({"train.state_dtype": "bfloat16"}, 4), ({}, 8),
    ({"train.update_compensation": "kahan"}, 10),
])  # fmt: skip
def test_bf16_true_bytes_per_parameter(overrides, states_per_param):
    """Weights and gradients 2 bytes; Adam's two moments in the state dtype, plus a bf16 Kahan
    compensation; no step tensor: bf16-true's AdamW counts steps in a Python int (its state on
    llama_micro after a real step holds exp_avg, exp_avg_sq and the Kahan buffer, and an int)."""
    run = method_run("full", "llama_7b", 3, 256, 1, {"train.precision": "bf16-true", **overrides})
    shapes = param_shapes("llama_7b", 32100)
    n = sum(s.numel() for s in shapes.values())
    e = build_memory(run).estimate(shapes, run)
    assert (e.weight_bytes, e.grad_bytes) == (2 * n, 2 * n)
    assert e.optimizer_state_bytes == states_per_param * n
