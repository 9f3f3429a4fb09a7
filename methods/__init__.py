"""Training methods. Each module here registers its method(s) or their companions (`_memory`);
importing this package finds them, and checks that every method has its companion."""

import importlib
import pkgutil

from harness.methods.base import (
    Method,
    build_memory,
    build_method,
    check_companions,
    get_memory,
    get_method,
    memory_of,
    method_names,
    optimizer_for,
    register,
    register_memory,
    schedule_of,
)
from harness.methods.memory import Memory, MemoryEstimate

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
check_companions()

__all__ = ["Memory", "MemoryEstimate", "Method", "build_memory", "build_method", "get_memory",
           "get_method", "memory_of", "method_names", "optimizer_for", "register",
           "register_memory", "schedule_of"]
