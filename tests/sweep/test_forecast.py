"""harness/sweep/plan/forecast.py: `harness sweep --dry-run` predicts each trial's peak, device time
and checkpoint bytes, and the sweep's totals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import micro_model

from harness.cli import main
from harness.sweep.plan.expand import expand, load_sweep
from harness.sweep.plan.forecast import device_time, forecast


def _sweep(tmp_path: Path, steps: int = 10, keep: int = 2, every: int = 0,
           **launcher) -> object:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "f", "model": "llama_micro", "device": "cpu",
        "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32},
        "train": {"steps": steps, "batch_size": 2, "precision": "32-true",
                  "keep_checkpoints": keep, "checkpoint_every": every},
        "methods": {"full": {"method": "full"}}, **({"launcher": launcher} if launcher else {})}))
    return load_sweep(path, {})


@pytest.mark.parametrize(("every", "kept"), [(0, 1), (2, 3), (4, 3), (6, 2)])
def test_checkpoints_are_weights_and_adam_states_counted_from_real_tensors(tmp_path, every,
                                                                           kept):
    """AdamW after one step holds exp_avg, exp_avg_sq and a 4-byte step per parameter tensor:
    counted on the model the trainer builds, times the checkpoints a 10-step trial keeps of
    3: only the final one (every 0); at 2, 4, ... 10 (every 2: 5 written, 3 kept); at 4, 8 and
    10 (every 4); at 6 and 10 (every 6)."""
    sweep = _sweep(tmp_path, keep=3, every=every)
    (record,) = forecast(sweep, expand(sweep), tmp_path / "runs")
    model = micro_model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert record["checkpoints_bytes"] == kept * (weights + states)


def test_device_time_is_linear_in_steps_and_processes(tmp_path):
    one = forecast(s := _sweep(tmp_path, steps=10), expand(s), tmp_path / "runs")[0]
    twice = forecast(s := _sweep(tmp_path, steps=20), expand(s), tmp_path / "runs")[0]
    assert twice["device_hours"] == pytest.approx(2 * one["device_hours"], rel=1e-12)
    assert one["speed"] == "model" and one["device_hours"] > 0


def test_measured_tokens_per_s_of_the_same_method_win(tmp_path):
    """Two finished `full` trials in the runs folder at 1,000 and 3,000 tok/s (and a failed one
    at 9,000, ignored): the median, 2,000; 10 steps x 2 x 32 tokens = 640 tokens: 0.32 s."""
    sweep = _sweep(tmp_path)
    runs = tmp_path / "runs"
    for name, status, rate in (("a", "ok", 1000.0), ("b", "ok", 3000.0), ("c", "failed", 9e3)):
        (runs / "trials" / name).mkdir(parents=True)
        (runs / "trials" / name / "summary.json").write_text(json.dumps(
            {"trial": name, "status": status, "method": "full", "tokens_per_s": rate}))
    (record,) = forecast(sweep, expand(sweep), runs)
    assert record["speed"] == "measured"
    assert record["device_hours"] * 3600 == pytest.approx(640 / 2000, rel=1e-12)


def test_device_time_reads_in_its_unit():
    assert [device_time(h) for h in (71.25, 0.5, 1 / 3600)] == ["71.2 h", "30.0 min", "1.0 s"]


def test_dry_run_prints_the_totals(tmp_path, capsys):
    _sweep(tmp_path)
    assert main(["sweep", str(tmp_path / "s.yaml"), "--dry-run", "--out",
                 str(tmp_path / "runs")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("1 trial, 640 tokens in all; predicted: ")
    assert "of device time (1 of them on the plan's compute model: an H100" in last
    assert "kept on disk (" in last and "at most while 1 run at once); the largest peak" in last
