"""Every registered method with every memory modifier and precision, in one matrix that
tests/modifiers/test_modifiers.py runs. Methods come from the registry, so a method registered
later runs with each modifier on its default settings, unless SETTINGS gives it smaller ones
for llama_micro or EXCLUDED says why it is left out."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import micro_run, train_losses

from harness.methods.base import method_names
from harness.methods.resolve import load_run
from harness.train import train

# Settings for 4 steps of llama_micro: small ranks, projections refreshed within the run.
SETTINGS: dict[str, dict[str, Any]] = {
    "adam8bit": {"min_8bit_size": 256},
    "lora": {"rank": 4},
    "relora": {"rank": 4, "reset_every": 2, "restart_warmup_steps": 1},
    "qlora": {"rank": 4},
    "lowrank": {"rank": 8},
    "galore": {"rank": 8, "update_proj_gap": 2},
    "qgalore": {"rank": 8, "update_proj_gap": 2},
    "apollo": {"rank": 8, "update_proj_gap": 2},
    "apollo_mini": {"update_proj_gap": 2},
    "fira": {"rank": 8, "update_proj_gap": 2},
}
EXCLUDED: dict[str, str] = {}  # a registered method the matrix leaves out -> why
METHODS: dict[str, dict[str, Any]] = {
    name: {"name": name, **SETTINGS.get(name, {})} for name in method_names()
    if name not in EXCLUDED
}
MODIFIERS: dict[str, dict[str, Any]] = {  # -> the run sections it sets
    "recompute_full": {"memory": {"recompute": "full"}},
    "recompute_attention": {"memory": {"recompute": ["attention"]}},
    "offload_mlp": {"memory": {"offload": ["mlp"], "offload_min_bytes": 0}},
    "layerwise": {"memory": {"layerwise": True}},
    "optimizer_offload": {"memory": {"optimizer_offload": "host"}},
    "16-mixed": {"train": {"precision": "16-mixed"}},
    "bf16_true_kahan": {"train": {"precision": "bf16-true", "update_compensation": "kahan"}},
    "bf16_true_bf16_states": {"memory": {"layerwise": True},
                              "train": {"precision": "bf16-true", "state_dtype": "bfloat16"}},
}
EXACT = ("recompute_full", "recompute_attention", "offload_mlp")  # the same arithmetic, on CPU
PRECISIONS = ("16-mixed", "bf16_true_kahan", "bf16_true_bf16_states")  # close, not equal
# Refused at load time, each with the method's reason (bf16_true_bf16_states is layer-wise).
REFUSED = {("relora", "layerwise"), ("relora", "optimizer_offload"),
           ("relora", "bf16_true_bf16_states"), ("qgalore", "optimizer_offload"),
           ("qgalore", "16-mixed"),
           ("schedule_free", "bf16_true_kahan"), ("schedule_free", "bf16_true_bf16_states")}
CASES = [(method, modifier) for method in METHODS for modifier in MODIFIERS]


def quick_cases() -> set[tuple[str, str]]:
    """A diagonal of the matrix for the quick test loop: each method with one modifier, the
    modifiers in turn so that each trains with at least one method (refused pairs passed
    over). The whole matrix is integration-tier (tests/conftest.py), as CI runs it."""
    order, picked, turn = list(MODIFIERS), set(), 0
    for method in METHODS:
        while (method, order[turn % len(order)]) in REFUSED:
            turn += 1
        picked.add((method, order[turn % len(order)]))
        turn += 1
    return picked


_baselines: dict[str, dict[int, float]] = {}


def run_config(method: str, modifier: str | None = None) -> dict[str, Any]:
    """4 steps of 2 micro-batches (accumulation runs too), no clipping: layer-wise clips each
    parameter on its own, so only unclipped steps are comparable."""
    data = micro_run(steps=4, grad_clip=None)
    data["eval"] = {"every": 0, "tokens": 256}
    data["method"] = METHODS[method]
    extra = MODIFIERS.get(modifier or "", {})
    data["train"].update(extra.get("train", {}))
    data["memory"] = extra.get("memory", {})
    return data


def baseline(method: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The method's losses without modifiers, trained once a session (inside a test, so on
    conftest's one thread)."""
    if method not in _baselines:
        out = tmp_path_factory.mktemp(f"{method}-plain")
        assert train(load_run(run_config(method)), out)["status"] == "ok"
        _baselines[method] = train_losses(out)
    return _baselines[method]
