"""The loop's events (harness/train/hooks.py): what registers on them, and when they fire."""

from __future__ import annotations

import pytest
from conftest import micro_run

from harness.methods.resolve import load_run
from harness.train import Trainer
from harness.train.hooks import Hooks, Step
from harness.trials import Records, read_jsonl


def test_events_fire_in_order_once_a_step_and_eval_before_the_last_only(tmp_path):
    run = load_run(micro_run(steps=4, log_every=2, total_batch_size=4))
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    try:
        assert trainer.method.steps is trainer.steps  # one arithmetic for loop and method
        assert (trainer.steps.world, trainer.steps.accumulation) == (1, 2)
        seen: list[tuple[str, int, bool]] = []
        for event in ("update", "step", "step_end", "eval"):
            trainer.hooks.on(event, lambda s, e=event: seen.append((e, s.number, s.last)))
        assert trainer.fit() == "ok"
    finally:
        trainer.close()
    steps = [[(e, n, n == 4) for e in ("update", "step", "step_end")] for n in (1, 2, 3, 4)]
    expected = [x for step in steps for x in step]
    # the trainer's evaluation, a "step_end" callback registered first, fires "eval"
    expected.insert(expected.index(("step_end", 3, False)), ("eval", 3, False))
    assert seen == expected
    logged = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert logged == [2, 4]


def test_callbacks_get_the_step_and_an_unknown_event_is_refused():
    hooks, calls = Hooks(), []
    hooks.on("step", lambda s: calls.append(s.number))
    hooks.fire("step", Step(1, None, False))  # type: ignore[arg-type]
    assert calls == [1]
    with pytest.raises(ValueError, match="unknown training event 'steps'"):
        hooks.on("steps", print)
