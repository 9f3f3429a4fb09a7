"""Training methods. Each file registers one; importing this package fills the registry."""

from harness.methods import adam8bit, full
from harness.methods.base import (
    MemoryEstimate,
    Method,
    build_method,
    get_method,
    method_names,
    register,
)

__all__ = [
    "MemoryEstimate",
    "Method",
    "adam8bit",
    "build_method",
    "full",
    "get_method",
    "method_names",
    "register",
]
