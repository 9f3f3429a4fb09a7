"""APOLLO-Mini's bytes (methods/apollo_mini.py): APOLLO's at rank 1 with one scaling factor
per matrix (its config's `projection`)."""

from typing import Any, ClassVar

from harness.methods.apollo_memory import APOLLOMemory
from harness.methods.base import register_memory


@register_memory("apollo_mini")
class APOLLOMiniMemory(APOLLOMemory):
    bench: ClassVar[dict[str, Any]] = {}  # no rank to set: rank 1 already
    variants: ClassVar[dict[str, dict[str, Any]]] = {
        "apollo_mini_int8_layerwise": {"method": "apollo_mini", "int8_weights": True}}
