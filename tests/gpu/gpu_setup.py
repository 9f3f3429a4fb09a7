"""Where and on what tests/gpu runs: the mode switch and the cases.

On a CUDA device (`pytest -m gpu`): llama_60m, each case a method with a memory modifier and a
precision. Every registered method trains, with every optimizer-side modifier (none, layer-wise,
host optimizer offload, paged) and every precision it accepts, but for what its optimizer cannot
tell apart (the principle of tests/method_matrix.py's docstring): recompute and activation
offload replace a decoder module's forward only, so a method that keeps the model as built
(not in the matrix's MODEL_METHODS, read from the registry) meets them as it meets `plain`;
32-true, bf16-mixed and 16-mixed hand it the same float32 weights and gradients (autocast and
the loss scale act on the forward and on the gradients before its step), so it meets one of
them; and Kahan summation is the shared compensation code's (harness/modifiers/compensation.py)
on a buffer of the weight's shape, so every method meets it as bf16-true. Recompute, activation
offload and the float32-weight precisions train with `full` (its fused AdamW reads the loss
scaler's overflow flag in its step) and with every method in MODEL_METHODS, Kahan summation
with every modifier (each modifier meets each precision it accepts), and on CPU the matrix
trains each method with each of them. Left out on CUDA: each
optimizer-only method with recompute, activation offload, the float32-weight precisions but
one, and Kahan summation; each model method with Kahan summation (`required` names the pairs).

Resumed on CUDA (stopped, resumed, compared with a run never stopped): one method of each kind
of state a checkpoint must bring back to the device (RESUMED_METHODS): 8-bit blockwise moments
(bitsandbytes, paged among them), 4-bit subclass moments (torchao), random projections drawn
from a generator on the device (APOLLO), INT8 weights and projections (Q-GaLore),
NF4 base weights (QLoRA), merged and reset adapters (ReLoRA). Not resumed on CUDA: the other
methods, whose states are tensors of the weights' shapes or smaller in torch's optimizer state
dict, loaded as these are; each one's resume is checked exact on CPU (tests/methods; full's in
tests/train). With HARNESS_GPU_SMOKE=1: the same tests on CPU at
llama_micro with tiny settings and a covering subset (every modifier and precision at least
once), so the code cannot rot between devices. Otherwise: skipped.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, NamedTuple

import torch
from conftest import micro_run
from method_matrix import METHODS, MODEL_METHODS

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

# The matrix's settings, but on CUDA 4-bit AdamW compiles its step as by default (a GPU run's
# path; the matrix turns it off for the CPU, where it gives the same numbers).
DEVICE_METHODS = {name: {k: v for k, v in settings.items() if not (CUDA and k == "compile_step")}
                  for name, settings in METHODS.items()}


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
    data.update(model=SHAPE["model"], device=DEVICE, method=DEVICE_METHODS[method],
                memory=MODIFIERS[modifier], eval={"every": 0, "tokens": 4 * SHAPE["seq_len"]})
    data["task"]["seq_len"] = SHAPE["seq_len"]
    # A final model only for QLoRA's cases, whose export dequantizes on the device: the rest
    # would each add a host rebuild and a write to the lease's minutes, and test nothing new.
    data["train"]["keep_final"] = "weights" if method == "qlora" else "none"
    return data


ALL = [Case(m, x, p) for m in METHODS for x in MODIFIERS for p in PRECISIONS]
# What a method's optimizer sees of a case (the module docstring): model-side modifiers and
# the float32-weight precisions change the forward and the gradients' making, not the step.
MODEL_SIDE = ("recompute", "offload")
FLOAT32 = ("32-true", "bf16-mixed", "16-mixed")
# Resumed on CUDA: one method of each kind of state a checkpoint must bring back on the
# device (the module docstring).
RESUMED_METHODS = ("adam8bit", "adam4bit", "apollo", "qgalore", "qlora", "relora")


def pairs(case: Case) -> set[tuple[str, str]]:
    method, modifier, precision = case
    return {(method, modifier), (method, precision), (modifier, precision)}


def seen(case: Case) -> tuple[str, str]:
    """The modifier and precision as `case.method` meets them: Kahan summation as bf16-true;
    for a method that keeps the model (not in MODEL_METHODS), a model-side modifier as
    `plain` and a float32-weight precision as `float32`."""
    method, modifier, precision = case
    precision = "bf16-true" if precision == "bf16-true-kahan" else precision
    if method in MODEL_METHODS:
        return modifier, precision
    return ("plain" if modifier in MODEL_SIDE else modifier,
            "float32" if precision in FLOAT32 else precision)


def required(case: Case) -> set[tuple[str, str]]:
    """The pairs a trained `case` meets: its method with the modifier and the precision it
    sees (`seen`), and its modifier with its precision."""
    modifier, precision = seen(case)
    return {(case.method, modifier), (case.method, precision), (case.modifier, case.precision)}


def covering() -> tuple[list[Case], list[Case]]:
    """Trained cases in which every pair `required` names for some accepted case meets at
    least once: method by method, its modifiers with the fewest accepted cases first (paged:
    float32 precisions only), each at the precision that covers most of its method's pairs
    still missing, then of all pairs; then cases for the pairs left. And one refused case per
    pair (of `pairs`) that no case accepts, for the test to see refused."""
    accepted = [c for c in ALL if refusal(c) is None]
    missing = set().union(*map(required, accepted))
    trained: list[Case] = []

    def own(case: Case) -> set[tuple[str, str]]:
        return {(case.method, x) for x in seen(case)} & missing

    def take(options: list[Case]) -> None:
        best = max(options, key=lambda c: (len(own(c)), len(required(c) & missing)))
        trained.append(best)
        missing.difference_update(required(best))

    # Methods that change the model first: only they meet the model-side modifiers' pairs.
    for method in sorted(METHODS, key=lambda m: m not in MODEL_METHODS):
        options = [c for c in accepted if c.method == method]
        kinds = Counter(seen(c)[0] for c in options)
        for modifier in sorted(kinds, key=kinds.__getitem__):
            if (method, modifier) in missing:
                take([c for c in options if seen(c)[0] == modifier])
        while any(map(own, options)):
            take(options)
    while missing:
        take(accepted)
    reachable = set().union(*map(pairs, accepted))
    refused = {pair: c for c in reversed(ALL) for pair in pairs(c) - reachable}
    return trained, sorted(set(refused.values()), key=ALL.index)


def diagonal(cases: list[Case]) -> list[Case]:
    """A case of each of RESUMED_METHODS, its step on the device (not `offload_host`, whose
    states live on the host), together covering as many modifiers and precisions as they can
    (the least used first, once all are in)."""
    used: Counter[str] = Counter()
    picked = []
    for method in RESUMED_METHODS:
        case = max((c for c in cases if c.method == method and c.modifier != "offload_host"),
                   key=lambda c: (len({c.modifier, c.precision} - set(used)),
                                  -used[c.modifier] - used[c.precision]))
        picked.append(case)
        used.update((case.modifier, case.precision))
    return picked


def spread(cases: list[Case], done: list[Case]) -> list[Case]:
    """Cases of `cases` in which every modifier and precision not in `done` trains once: each
    the one with most of those still missing (the first on a tie)."""
    missing = set(MODIFIERS) | set(PRECISIONS)
    missing -= {x for c in done for x in (c.modifier, c.precision)}
    picked = []
    while missing:
        best = max(cases, key=lambda c: len({c.modifier, c.precision} & missing))
        picked.append(best)
        missing -= {best.modifier, best.precision}
    return picked


COVERING, REFUSED = covering()
DIAGONAL = diagonal(COVERING)
# Resumed (stopped at STOP, resumed, compared with a run never stopped): on CUDA the diagonal,
# the rest trained. In the smoke form the diagonal's first case, and enough of the rest for
# every modifier and precision to train once: each method trains on the CPU with the
# modifiers and precisions in tests/method_matrix.py, with these very settings.
CUDA_RESUMED, CUDA_TRAINED = DIAGONAL, [c for c in COVERING if c not in DIAGONAL]
if SMOKE:
    RESUMED = DIAGONAL[:1]
    TRAINED = spread(DIAGONAL[1:] + CUDA_TRAINED, RESUMED)
else:
    RESUMED, TRAINED = CUDA_RESUMED, CUDA_TRAINED
