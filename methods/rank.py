"""A rank that saves nothing: at or above a target matrix's smaller dimension, GaLore (and Fira
and APOLLO, built on it) update that matrix unprojected (methods/projection.py `side_of`),
and LoRA's adapters or low-rank factors hold more weights than the matrix itself. Not an
error (the run is still valid), but said at load time in one line and kept in the trial's
summary (`warnings`)."""

from __future__ import annotations

from collections import Counter

from harness.methods.base import Method, memory_of
from harness.methods.memory import Shapes
from harness.methods.surgery import is_target

# What a too-large rank does, by what the method makes of its target linears (Memory.linears).
CONSEQUENCE = {
    "adapter": "their adapters B·A hold more weights than the matrices",
    "factored": "their factors B·A hold more weights than the matrices",
    "float": "they are updated unprojected, as AdamW would",
    "quantized": "Q-GaLore updates them unprojected",
}


def targeted(method: Method, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the parameter `name` of the base model is one of the method's rank-r targets:
    its config's own rule where it has one (GaLore's: any name component), else peft's (the
    last)."""
    own = getattr(method.config, "targeted", None)
    if own is not None:
        return bool(own(name, shape))
    module, _, leaf = name.rpartition(".")
    targets = getattr(method.config, "target_modules", ())
    return leaf == "weight" and len(shape) == 2 and is_target(module, targets)


def rank_warning(method: Method, shapes: Shapes) -> str | None:
    """One line naming the target matrices whose smaller dimension is at most the method's
    rank, and the limit below which every target saves memory; None if the rank is fine (or
    the method has none)."""
    rank = getattr(method.config, "rank", None)
    if rank is None:
        return None
    over = [(name, min(shape)) for name, shape in shapes.items()
            if targeted(method, name, tuple(shape)) and rank >= min(shape)]
    if not over:
        return None
    counts = Counter(name.rpartition(".")[0].rsplit(".", 1)[-1] for name, _ in over)
    leaves = ", ".join(f"{leaf} ×{n}" for leaf, n in counts.items())  # q_proj ×2, ...
    low, high = min(d for _, d in over), max(d for _, d in over)
    dims = f"{low}" if low == high else f"{low} to {high}"
    why = CONSEQUENCE.get(memory_of(method).linears, "they are no smaller")
    return (f"method.rank {rank} is at or above the smaller dimension ({dims}) of "
            f"{len(over)} target matrices ({leaves}): {why}, saving no memory there; "
            f"use a rank below {low}")
