"""The `grad_norm` metric: the global L2 norm of every gradient before clipping, on each logged
step (its metrics line) and their mean (the summary), computed here by hand from `p.grad`."""

from __future__ import annotations

import pytest
import torch
from conftest import micro_run

from harness.methods.resolve import load_run
from harness.train import Trainer, train
from harness.trials import Records, read_jsonl

# The harness sums 1.1M float32 squares; the norm by hand, in float64, differs by up to 8e-5.
REL = 2e-4


def by_hand(trainer: Trainer) -> tuple[list[float], list[float]]:
    """Each step's norm of the concatenated gradients, taken just before the precision step
    (before any clipping) and at "update" (after it), without the harness's norm code."""
    before: list[float] = []
    after: list[float] = []

    def norm() -> float:
        grads = [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.cat(grads).double()).item()

    step = trainer.precision.step

    def measured_step(*args, **kwargs):
        before.append(norm())
        return step(*args, **kwargs)

    trainer.precision.step = measured_step  # type: ignore[method-assign]
    trainer.hooks.on("update", lambda _: after.append(norm()))
    return before, after


def fit(tmp_path, **train_keys) -> tuple[dict, list[dict], list[float], list[float]]:
    run = load_run(micro_run(**train_keys))
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    before, after = by_hand(trainer)
    trainer.fit()
    lines = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    return trainer.results(), lines, before, after


def test_each_logged_steps_norm_and_their_mean(tmp_path):
    """Five steps logged every two: lines at steps 2, 4 and 5 (the last), each with that
    step's norm; the summary's is the mean of those three, not of all five."""
    results, lines, before, after = fit(tmp_path, steps=5, log_every=2, grad_clip=None)
    assert [r["step"] for r in lines] == [2, 4, 5]
    logged = [before[1], before[3], before[4]]
    assert [r["grad_norm"] for r in lines] == pytest.approx(logged, rel=REL)
    assert results["grad_norm"] == pytest.approx(sum(logged) / 3, rel=REL)
    assert results["grad_norm"] != pytest.approx(sum(before) / 5, rel=1e-3)
    assert after == pytest.approx(before, rel=1e-6)  # no clipping: the gradients as they were


def test_the_norm_is_taken_before_clipping(tmp_path):
    """A clip far below the gradients' norm: the step sees gradients of norm `grad_clip`, the
    metric the norm they had."""
    results, lines, before, after = fit(tmp_path, steps=3, log_every=1, grad_clip=1e-3)
    assert min(before) > 1e-2  # so the clip acts on every step
    assert after == pytest.approx([1e-3] * 3, rel=1e-4)
    assert [r["grad_norm"] for r in lines] == pytest.approx(before, rel=REL)
    assert results["grad_norm"] == pytest.approx(sum(before) / 3, rel=REL)


def test_measuring_changes_no_weight(tmp_path):
    """Norms on every step, or on the last only: the same training to the last bit."""
    every = train(load_run(micro_run(steps=4, log_every=1, grad_clip=None)), tmp_path / "every")
    last = train(load_run(micro_run(steps=4, log_every=10, grad_clip=None)), tmp_path / "last")
    assert every["eval_loss"] == last["eval_loss"] and every["grad_norm"] != last["grad_norm"]


def test_a_resumed_trial_keeps_the_mean_over_all_its_logged_steps(tmp_path):
    run = load_run(micro_run(steps=6))
    straight = train(run, tmp_path / "straight")
    stopped = train(run, tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert stopped["status"] == "interrupted"
    resumed = train(run, tmp_path / "resumed")
    lines = [r["grad_norm"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
             if r["kind"] == "train"]
    assert len(lines) == 6 and resumed["grad_norm"] == pytest.approx(sum(lines) / 6, rel=1e-9)
    assert resumed["grad_norm"] == pytest.approx(straight["grad_norm"], rel=1e-6)


def test_layerwise_updates_record_no_norm(tmp_path):
    """Each gradient is used and freed inside backward: no global norm exists to record."""
    data = {**micro_run(steps=2), "memory": {"layerwise": True}}
    summary = train(load_run(data), tmp_path / "t")
    assert summary["status"] == "ok" and summary["grad_norm"] is None
    lines = [r for r in read_jsonl(tmp_path / "t" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(lines) == 2 and not any("grad_norm" in r for r in lines)
