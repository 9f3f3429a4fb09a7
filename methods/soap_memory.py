"""SOAP's bytes (methods/soap.py): Adam's two moments of every trained element and, for each
side of a matrix that is rotated (at most max_precond_dim), its statistic and its eigenbasis,
each d×d, all at the state width; a Kahan buffer per element under bf16-true with kahan. The
step count is a Python int: no bytes. The step's float32 temporaries are one tensor's at a
time (`temporaries`); a refresh's power iteration and QR (about four d×d and the second
moment's reordered copy, every `precondition_frequency` steps) are not counted, as GaLore's
SVD is not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.soap import rotated
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("soap")
class SOAPMemory(Memory):
    # the hidden sides of every preset up to llama_1b's 2048 rotated, a vocabulary side never
    # (an 8192² eigendecomposition and QR would make most of a CPU step)
    bench: ClassVar[dict[str, Any]] = {"max_precond_dim": 4096}

    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """The float32 temporaries of the tensor whose step holds the most (one at a time)."""
        d = self.config.max_precond_dim
        return 4 * max(temporaries(tuple(s), rotated(s, d), run) for s in shapes.values())

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """2·numel moments and 2·d² per rotated side d of each tensor, at the state width."""
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        sides = sum(2 * d * d for s in shapes.values()
                    for d in rotated(s, self.config.max_precond_dim))
        states = (2 * w.state + w.compensation) * sum(sizes) + w.state * sides
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)


def temporaries(shape: tuple[int, ...], sides: list[int], run: RunConfig) -> int:
    """Float32 values methods/soap.py's step holds at once for an m×n tensor rotated on `sides`
    (0: not), beside its states and gradients: a rotation makes Q_Lᵀ·X, then ·Q_R; the update
    beside √V; the rotation back beside the update; the statistics' outer product d×d. Under
    bf16-true the gradient's float32 copy lives throughout, and bfloat16 states add float32
    copies of both moments (while the update is made), of the bases and of a statistic."""
    mn, kept = numel(shape), [d for d in sides if d]
    t = run.train
    copies = t.precision == "bf16-true" and t.state_dtype == "bfloat16"
    moments = 2 * mn if copies else 0
    into = (2 if len(kept) == 2 else 1) * mn  # a vector's rotation is a copy
    outer = max((d * d for d in kept), default=0)
    stages = [moments + into,  # V's update, from the rotated gradient
              moments + 2 * mn,  # the update and √V + ε
              (1 + max(len(kept), 1)) * mn,  # the rotation back, beside the update
              (2 if copies else 1) * outer]  # a statistic's outer product (and its copy)
    gradient = mn if t.precision == "bf16-true" else 0
    bases = sum(d * d for d in kept) if copies else 0
    return gradient + bases + max(stages)
