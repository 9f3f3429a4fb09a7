"""COAP's bytes (methods/coap.py): GaLore's, a basis (P: m×r, or Q: r×n) as extra bytes and
the low-rank AdamW moments as state; the projection step's gradient is freed at once."""

from __future__ import annotations

from harness.methods.base import register_memory
from harness.methods.galore_memory import GaLoreMemory


@register_memory("coap")
class COAPMemory(GaLoreMemory):
    """GaLore's arithmetic on COAP's settings (one side, AdamW moments)."""
