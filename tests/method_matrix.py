"""Every registered method with every memory modifier and precision, in one matrix that
tests/modifiers/test_modifiers.py runs. Methods come from the registry, so a method registered
later runs with each modifier on its default settings, unless SETTINGS gives it smaller ones
for llama_micro or EXCLUDED says why it is left out.

Which pairs train (CASES). The model-side modifiers (EXACT: recompute, activation offload)
replace a decoder module's `forward` and nothing else: the parameters, their names and the
gradients stay those of the plain run (asserted bitwise against each trained method's plain
losses; the names and tensors by test_model_side_modifiers_keep_the_parameters). A method sees
the model only through its `prepare` hook (modules wrapped, quantized, factored or frozen) and
the gradients through its optimizer. So for a method that keeps the model as built and updates
after backward, a model-side modifier's run is the plain run: the same gradients reach the same
optimizer, and one such method (REPRESENTATIVE) training each of them covers them all. Every
method with a `prepare` of its own, or whose optimizer updates inside backward (a recomputed
forward could meet a weight already updated), trains with every model-side modifier
(MODEL_METHODS, read from the registry: a method registered later is classified by its class).
The optimizer-side modifiers (layer-wise, host optimizer offload) and the precisions change the
update itself and train with every method. The pairs left out are still loaded, accepted or
refused as listed (test_every_pair_loads_as_the_matrix_says), and their estimates are the
method's own, which its precision cases compare with the bytes counted.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import micro_run, train_losses

from harness.methods.base import Method, build_method, get_method, method_names
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
    "adam4bit": {"compile_step": False},  # torch.compile on CPU: seconds a shape, same numbers
    "stable_spam": {"update_proj_gap": 2},  # a momentum reset within the 4 steps
    "coap": {"rank": 8, "update_proj_gap": 1, "reproject_factor": 2},  # both refresh kinds
    "frugal": {"update_proj_gap": 2},
    # bases refreshed within the 4 steps; the 64 and 176 sides rotated, the 8192-token
    # vocabulary side not (an 8192² eigendecomposition and QR would make most of a CPU step)
    "soap": {"precondition_frequency": 2, "max_precond_dim": 4096},
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
# Model-side: the decoder's forward only, the same arithmetic on CPU (the module docstring).
EXACT = ("recompute_full", "recompute_attention", "offload_mlp")
PRECISIONS = ("16-mixed", "bf16_true_kahan", "bf16_true_bf16_states")  # close, not equal
# Refused at load time, each with the method's reason (bf16_true_bf16_states is layer-wise).
REFUSED = {("relora", "layerwise"), ("relora", "optimizer_offload"),
           ("relora", "bf16_true_bf16_states"), ("qgalore", "optimizer_offload"),
           ("qgalore", "16-mixed"), ("adam4bit", "bf16_true_kahan"),
           ("schedule_free", "bf16_true_kahan"), ("schedule_free", "bf16_true_bf16_states")}
REPRESENTATIVE = "full"  # trains the model-side modifiers for the methods that keep the model
ALL_PAIRS = [(method, modifier) for method in METHODS for modifier in MODIFIERS]


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


def changes_the_model(method: str) -> bool:
    """Its class has a `prepare` of its own, or its optimizer updates inside backward."""
    if get_method(method).prepare is not Method.prepare:
        return True
    run = load_run(run_config(method))
    return build_method(run).check(run).in_backward


MODEL_METHODS = {m for m in METHODS if m == REPRESENTATIVE or changes_the_model(m)}
CASES = [(method, modifier) for method, modifier in ALL_PAIRS
         if modifier not in EXACT or method in MODEL_METHODS]


# 16-mixed changes the forward (fp16 autocast) and wraps the step: GradScaler unscales every
# gradient of the optimizer's `param_groups` to float32 in place, then steps, or skips a step
# whose gradients overflowed. A method that keeps the model and steps after backward meets it
# only through its groups (test_every_methods_groups_hold_its_trained_parameters) and one
# `step()`, so one optimizer of each kind trains it: torch's fused AdamW (full, handed the
# scale), an own optimizer stepped by GradScaler (GaLore), bitsandbytes' (8-bit Adam) and
# torchao's (4-bit AdamW); every method that changes the model trains it too. The other
# pairs are EXHAUSTIVE (tests/tiers.py): `pytest --exhaustive` runs them.
SCALER_KINDS = {"full", "galore", "adam8bit", "adam4bit"}


def exhaustive_cases() -> set[tuple[str, str]]:
    return {(m, "16-mixed") for m in METHODS
            if m not in MODEL_METHODS | SCALER_KINDS} - quick_cases()


def quick_cases() -> set[tuple[str, str]]:
    """A diagonal of the matrix for the quick test loop: each method with one modifier, the
    one its earlier methods trained least (in MODIFIERS' order on a tie), so that each
    modifier trains with at least one method (refused pairs passed over). The whole matrix
    is integration-tier (tests/conftest.py), as CI runs it."""
    picked: set[tuple[str, str]] = set()
    uses = dict.fromkeys(MODIFIERS, 0)
    for method in METHODS:
        open_ = [x for x in MODIFIERS if (method, x) in CASES and (method, x) not in REFUSED]
        modifier = min(open_, key=lambda x: uses[x])
        picked.add((method, modifier))
        uses[modifier] += 1
    return picked


_baselines: dict[str, dict[int, float]] = {}


def baseline(method: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The method's losses without modifiers, trained once a session (inside a test, so on
    conftest's one thread)."""
    if method not in _baselines:
        out = tmp_path_factory.mktemp(f"{method}-plain")
        assert train(load_run(run_config(method)), out)["status"] == "ok"
        _baselines[method] = train_losses(out)
    return _baselines[method]
