"""The loop: exact resume, NaN handling, summary fields, memory breakdown, eval arithmetic."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_estimate_matches, micro_run

from harness.config.steps import lr_factor
from harness.data.c4 import eval_blocks
from harness.data.loader import IGNORE, to_batch
from harness.errors import UserError
from harness.methods import build_memory
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import Trainer, train
from harness.trials import Records, read_jsonl

SUMMARY_KEYS = {
    "status",
    "method",
    "params",
    "lr",
    "seed",
    "steps",
    "tokens",
    "eval_loss",
    "eval_ppl",
    "tokens_per_s",
    "peak_memory_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "trainable_params",
    "wall_s",
    "error",
}


def losses(out: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"]) for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"
    ]


@pytest.mark.parametrize("method", ["full", "adam8bit"])
def test_resume_gives_the_same_losses_step_for_step(tmp_path, method):
    run = load_run({**micro_run(steps=6), "method": {"name": method}})
    train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert (first["status"], first["step"]) == ("interrupted", 3)
    second = train(run, tmp_path / "resumed")
    assert second["status"] == "ok" and second["step"] == 6
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert [s for s, _ in losses(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
    assert second["eval_ppl"] == pytest.approx(
        train(run, tmp_path / "straight")["eval_ppl"], rel=0, abs=0
    )


def test_summary_has_every_field_and_real_memory_counts(tmp_path):
    run = load_run({**micro_run(steps=2), "method": {"name": "adam8bit"}})
    summary = train(run, tmp_path / "t")
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["status"] == "ok" and summary["error"] is None
    assert summary["tokens"] == 2 * 4 * 32
    assert summary["eval_ppl"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert summary["peak_memory_bytes"] > summary["param_bytes"] > 0
    assert summary["trainable_params"] * 4 == summary["param_bytes"] == summary["grad_bytes"]
    # 8-bit moments: well under the 8 bytes per parameter of 32-bit Adam
    assert summary["optimizer_state_bytes"] < 4 * summary["trainable_params"]


@pytest.mark.parametrize("method", ["full", "adam8bit"])
def test_estimator_matches_the_real_tensors(tmp_path, method):
    run = load_run({**micro_run(steps=1), "method": {"name": method}})
    summary = train(run, tmp_path / "t")
    shapes = param_shapes(run.model, 8192)  # the sample tokenizer's vocab
    estimate = build_memory(run).estimate(shapes, run)
    assert_estimate_matches(estimate, summary)
    assert summary["extra_bytes"] == 0


def test_nan_loss_ends_the_trial_with_status_nan(tmp_path):
    summary = train(load_run(micro_run(lr=1e30)), tmp_path / "t")
    assert summary["status"] == "nan" and "loss is nan" in summary["error"]
    assert summary["step"] < 6


def test_finished_run_is_not_run_again_and_other_configs_are_refused(tmp_path):
    run = load_run(micro_run(steps=2))
    train(run, tmp_path / "t")
    before = (tmp_path / "t" / "metrics.jsonl").read_text()
    assert train(run, tmp_path / "t")["status"] == "ok"
    assert (tmp_path / "t" / "metrics.jsonl").read_text() == before
    with pytest.raises(UserError, match="finished with a different config"):
        train(load_run(micro_run(steps=3)), tmp_path / "t")
    # a trial finished before final models existed: its checkpoint says whose it is
    train(run.model_copy(update={"train": run.train.model_copy(update={"keep_final": "full"})}),
          tmp_path / "old")
    summary = json.loads((tmp_path / "old" / "summary.json").read_text())
    del summary["keep_final"], summary["identity"]
    (tmp_path / "old" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(UserError, match="written by a different config"):
        train(load_run(micro_run(steps=3)), tmp_path / "old")


def test_eval_perplexity_is_token_weighted_not_a_mean_of_batch_means(tmp_path):
    data = micro_run(steps=1)
    data["task"]["packing"] = False  # padded blocks: batches hold different token counts
    data["eval"] = {"tokens": 300, "batch_size": 3}
    run = load_run(data)
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    result = trainer.evaluate()
    blocks = eval_blocks(run.task, trainer.tok, 300)
    sums, counts = [], []
    with torch.no_grad():
        for i in range(0, len(blocks), 3):
            ids, labels = to_batch(blocks[i : i + 3], pin=False)
            logits = trainer.model(input_ids=ids).logits[:, :-1]
            target = labels[:, 1:]
            sums.append(
                float(
                    F.cross_entropy(
                        logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="sum"
                    )
                )
            )
            counts.append(int((target != IGNORE).sum()))
    trainer.close()
    assert len(set(counts)) > 1
    assert result["eval_tokens"] == sum(counts) >= 300
    assert result["eval_loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-6)
    batch_means = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
    assert abs(result["eval_loss"] - batch_means) > 1e-4


def test_wandb_logs_offline_into_the_run_folder(tmp_path):
    run = load_run({**micro_run(steps=2), "wandb": {"enabled": True}})
    assert train(run, tmp_path / "t")["status"] == "ok"
    offline = list((tmp_path / "t" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))


def test_schedule_warms_up_then_decays_to_the_floor():
    run = load_run(micro_run(steps=10, warmup_steps=2, min_lr_ratio=0.1))
    factors = [lr_factor(s, run.train) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[1:]))
    assert lr_factor(10, run.train) == pytest.approx(0.1)


def test_compile_trains_the_same_model(tmp_path):
    """train.compile compiles each decoder layer and the loss: the same losses (to float
    rounding) and a checkpoint with the same keys as the eager run."""
    runs = {c: load_run(micro_run(steps=3, compile=c, keep_final="full")) for c in (False, True)}
    summaries = {c: train(r, tmp_path / str(c)) for c, r in runs.items()}
    assert all(s["status"] == "ok" for s in summaries.values())
    assert math.isclose(summaries[True]["eval_loss"], summaries[False]["eval_loss"], rel_tol=1e-5)
    state = {c: torch.load(tmp_path / str(c) / "checkpoint" / "state.pt", weights_only=False)
             for c in runs}
    keys = {c: set(s["model"]) for c, s in state.items()}
    assert keys[True] == keys[False]
