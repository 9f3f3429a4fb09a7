"""Training methods. Each module here registers its method(s); importing this package finds them."""

import importlib
import pkgutil

from harness.methods.base import (
    MemoryEstimate,
    Method,
    build_method,
    get_method,
    method_names,
    register,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["MemoryEstimate", "Method", "build_method", "get_method", "method_names", "register"]
