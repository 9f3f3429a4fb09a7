"""Where and on what tests/gpu runs: the mode switch and the cases.

On a CUDA device (`pytest -m gpu`): llama_60m, every pair of method, memory modifier and
precision in at least one trained case. With HARNESS_GPU_SMOKE=1: the same tests on CPU at
llama_micro with tiny settings and a covering subset (every method once, every modifier and
precision at least once), so the code cannot rot between devices. Otherwise: skipped.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, NamedTuple

import torch
from conftest import micro_run
from method_matrix import METHODS

SMOKE = os.environ.get("HARNESS_GPU_SMOKE") == "1"
CUDA = torch.cuda.is_available() and not SMOKE
SKIP_REASON = ("needs a CUDA device: `pytest -m gpu` runs them there "
               "(`HARNESS_GPU_SMOKE=1 pytest -m gpu`: their smoke form on CPU)")
DEVICE = "cuda" if CUDA else "cpu"
STEPS, STOP = 4, 2  # a resumed case stops after step STOP and resumes to STEPS
# Micro-batches of 4 x 128 tokens, 2 per step, on CUDA; micro_run's 2 x 32 in the smoke form.
SHAPE: dict[str, Any] = (
    {"model": "llama_60m", "seq_len": 128, "batch_size": 4, "total_batch_size": 8} if CUDA
    else {"model": "llama_micro", "seq_len": 32, "batch_size": 2, "total_batch_size": 4})

MODIFIERS: dict[str, dict[str, Any]] = {  # -> memory section
    "plain": {},
    "recompute": {"recompute": "full"},
    "offload": {"offload": ["attention", "mlp"], "offload_min_bytes": 0},  # activations
    "layerwise": {"layerwise": True},
    "offload_host": {"optimizer_offload": "host"},
    "offload_paged": {"optimizer_offload": "paged"},
}
PRECISIONS: dict[str, dict[str, Any]] = {  # -> train keys
    "32-true": {"precision": "32-true"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "16-mixed": {"precision": "16-mixed"},
    "bf16-true": {"precision": "bf16-true"},
    "bf16-true-kahan": {"precision": "bf16-true", "update_compensation": "kahan"},
    "bf16-true-sr-bf16": {"precision": "bf16-true", "update_compensation": "stochastic_rounding",
                          "state_dtype": "bfloat16"},
}
# What each method refuses (its `refusal` says why): states that are not bitsandbytes' cannot
# be paged; ReLoRA's resets and Q-GaLore's INT8 updates inside backward need the whole optimizer
# on the device, and Q-GaLore's cannot be undone by fp16's skipped steps.
OWN_STATES = ("adam_mini", "galore", "apollo", "apollo_mini", "fira", "muon", "lion",
              "ademamix", "mars", "stable_spam", "coap", "frugal", "soap", "normuon",
              "came")
METHOD_REFUSES: dict[str, set[str]] = {
    "relora": {"layerwise", "offload_host", "offload_paged"},
    "qgalore": {"offload_host", "offload_paged", "16-mixed"},
    **{name: {"offload_paged"} for name in OWN_STATES},
    # torchao's quantized moments cannot be paged; its step keeps no Kahan buffer
    "adam4bit": {"offload_paged", "bf16-true-kahan"},
    # its train/eval switch moves bfloat16 weights in place (methods/schedule_free.py)
    "schedule_free": {"offload_paged", "bf16-true", "bf16-true-kahan", "bf16-true-sr-bf16"},
}


class Case(NamedTuple):
    method: str
    modifier: str
    precision: str

    @property
    def id(self) -> str:
        return "-".join(self)


def refusal(case: Case) -> str | None:
    """The start of the error `load_run` must raise for `case`, or None where it trains."""
    method, modifier, precision = case
    if modifier == "layerwise" and precision == "16-mixed":
        return "config: memory.layerwise with train.precision fp16 (16-mixed)"
    if modifier == "offload_paged" and precision.startswith("bf16-true"):
        return "memory.optimizer_offload paged with train.precision bf16-true"
    if {modifier, precision} & METHOD_REFUSES.get(method, set()):
        return f"method {method}: "
    return None


def run_config(case: Case) -> dict[str, Any]:
    """`case` as a run on DEVICE, STEPS steps of SHAPE, the matrix's small method settings."""
    method, modifier, precision = case
    data = micro_run(steps=STEPS, batch_size=SHAPE["batch_size"],
                     total_batch_size=SHAPE["total_batch_size"], **PRECISIONS[precision])
    data.update(model=SHAPE["model"], device=DEVICE, method=METHODS[method],
                memory=MODIFIERS[modifier], eval={"every": 0, "tokens": 4 * SHAPE["seq_len"]})
    data["task"]["seq_len"] = SHAPE["seq_len"]
    # A final model only for QLoRA's cases, whose export dequantizes on the device: the rest
    # would each add a host rebuild and a write to the lease's minutes, and test nothing new.
    data["train"]["keep_final"] = "weights" if method == "qlora" else "none"
    return data


ALL = [Case(m, x, p) for m in METHODS for x in MODIFIERS for p in PRECISIONS]


def pairs(case: Case) -> set[tuple[str, str]]:
    method, modifier, precision = case
    return {(method, modifier), (method, precision), (modifier, precision)}


def covering() -> tuple[list[Case], list[Case]]:
    """Trained cases in which every pair (method, modifier, precision) that some case accepts
    meets at least once: each method with each modifier, at the precision that covers most
    pairs still missing, then cases for the pairs left. And one refused case per pair that no
    case accepts, for the test to see refused."""
    accepted = [c for c in ALL if refusal(c) is None]
    missing = set().union(*map(pairs, accepted))
    trained: list[Case] = []

    def take(options: list[Case]) -> None:
        best = max(options, key=lambda c: len(pairs(c) & missing))
        trained.append(best)
        missing.difference_update(pairs(best))

    for method in METHODS:
        for modifier in MODIFIERS:
            options = [c for c in accepted if c[:2] == (method, modifier)]
            if options:
                take(options)
    while missing:
        take(accepted)
    reachable = set().union(*map(pairs, accepted))
    refused = {pair: c for c in reversed(ALL) for pair in pairs(c) - reachable}
    return trained, sorted(set(refused.values()), key=ALL.index)


def diagonal(cases: list[Case]) -> list[Case]:
    """Each method once, in cases that together cover every modifier and precision (the
    least used first, once all are in)."""
    used: Counter[str] = Counter()
    picked = []
    for method in METHODS:
        case = max((c for c in cases if c.method == method),
                   key=lambda c: (len({c.modifier, c.precision} - set(used)),
                                  -used[c.modifier] - used[c.precision]))
        picked.append(case)
        used.update((case.modifier, case.precision))
    return picked


TRAINED, REFUSED = covering()
DIAGONAL = diagonal(TRAINED)
# Resumed (stopped at STOP, resumed, compared with a run never stopped): on CUDA each method
# once, the diagonal; in the smoke form its first case, and the rest of it trains once.
if SMOKE:
    RESUMED, TRAINED = DIAGONAL[:1], DIAGONAL[1:]
else:
    RESUMED, TRAINED = DIAGONAL, [c for c in TRAINED if c not in DIAGONAL]
