"""SOAP's bytes (methods/soap.py): Adam's two moments of every trained element and, for each
side of a matrix that is rotated (at most max_precond_dim), its statistic and its eigenbasis,
each d×d, all at the state width; a Kahan buffer per element under bf16-true with kahan. The
step count is a Python int: no bytes."""

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

    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        return True  # one tensor at a time: rotated whole

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """2·numel moments and 2·d² per rotated side d of each tensor, at the state width."""
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        sides = sum(2 * d * d for s in shapes.values()
                    for d in rotated(s, self.config.max_precond_dim))
        states = (2 * w.state + w.compensation) * sum(sizes) + w.state * sides
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
