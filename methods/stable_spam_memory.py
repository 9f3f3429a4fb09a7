"""Stable-SPAM's bytes (methods/stable_spam.py): two moments per element at the state width and
three float32 scalars per tensor (AdaGN's norm moments, AdaClip's running max)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.methods.base import register_memory
from harness.methods.memory import Memory, MemoryEstimate, Shapes, grad_bytes, numel
from harness.methods.stable_spam import CLIP_CHUNK, SCALARS
from harness.methods.widths import widths

if TYPE_CHECKING:
    from harness.config import RunConfig


@register_memory("stable_spam")
class StableSpamMemory(Memory):
    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """The largest tensor's temporaries at once: the float32 clipped gradient, the clip's
        mask (1 byte an element) and a chunk's rescaled values (`CLIP_CHUNK`); then the
        denominator, which becomes the update; bf16-true adds the weight's float32 copy beside
        the update, and bfloat16 moments their float32 copies beside the clipped gradient."""
        t, n = run.train, max(numel(s) for s in shapes.values())
        clip = 5 * n + 4 * min(n, CLIP_CHUNK)
        if t.precision != "bf16-true":
            return clip
        return max(clip, (8 if t.state_dtype == "float32" else 12) * n)

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """(2·state + compensation)·n, and 4 bytes for each of the scalars of every tensor
        (whole on every rank under fsdp: `estimate_sharded` passes each rank's rows)."""
        w = widths(run)
        sizes = [numel(s) for s in shapes.values()]
        states = (2 * w.state + w.compensation) * sum(sizes) + 4 * len(SCALARS) * len(sizes)
        return MemoryEstimate(w.weight * sum(sizes), grad_bytes(sizes, run, self.steps), states)
