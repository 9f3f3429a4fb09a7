"""methods/rank.py: a rank at or above a target matrix's smaller dimension saves nothing; said
in one line at load time and kept in the summary."""

from __future__ import annotations

import json

import pytest
from conftest import micro_run

from harness.methods import build_method
from harness.methods.rank import rank_warning
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import train

SHAPES = param_shapes("llama_micro", 8192)  # hidden 64: every target's smaller side is 64
RANKED = ["lora", "relora", "qlora", "lowrank", "galore", "qgalore"]


def method(name: str, **params):
    return build_method(load_run({**micro_run(), "method": {"name": name, **params}}))


@pytest.mark.parametrize("name", RANKED)
def test_a_rank_at_or_above_the_smaller_dimension_is_named_with_its_limit(name):
    line = rank_warning(method(name, rank=4096), SHAPES)
    assert line is not None and "\n" not in line
    assert line.startswith("method.rank 4096 is at or above the smaller dimension (64)")
    assert "14 target matrices" in line and "q_proj ×2" in line and "down_proj ×2" in line
    assert line.endswith("use a rank below 64")
    assert rank_warning(method(name, rank=64), SHAPES) is not None  # equal: no saving either


@pytest.mark.parametrize("name", RANKED)
def test_a_rank_below_every_targets_smaller_dimension_is_fine(name):
    assert rank_warning(method(name, rank=32), SHAPES) is None


def test_only_the_targets_count_and_methods_without_a_rank_say_nothing():
    assert rank_warning(method("full"), SHAPES) is None
    line = rank_warning(method("lora", rank=4096, target_modules=["q_proj"]), SHAPES)
    assert "2 target matrices (q_proj ×2)" in line
    assert "unprojected" in rank_warning(method("galore", rank=4096), SHAPES)
    assert "adapters" in rank_warning(method("lora", rank=4096), SHAPES)


def test_the_trial_prints_it_at_load_and_keeps_it_in_the_summary(tmp_path, capsys):
    run = load_run({**micro_run(steps=1), "method": {"name": "lowrank", "rank": 128}})
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok"
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning: ")]
    assert summary["warnings"] == [line.removeprefix("warning: ")]
    assert "method.rank 128" in line
    assert json.loads((tmp_path / "t" / "summary.json").read_text())["warnings"] == [
        line.removeprefix("warning: ")]
    quiet = train(load_run({**micro_run(steps=1), "method": {"name": "lowrank", "rank": 8}}),
                  tmp_path / "quiet")
    assert "warnings" not in quiet
