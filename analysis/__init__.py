"""Read sweep results from run directories and report them.

`load_runs` / `load_steps` turn a RUNS_DIR (or several) into pandas tables; `summary_table`
compares methods at their own best learning rate; `status_table` is what `harness status`
prints; `write_report` writes report.html, report.md, the tables and the figures under
RUNS_DIR/report/.

Each name loads its module when first asked for (PEP 562): `harness sweep` and `harness status`
print a table, and `harness estimate` reads the papers' CSVs from this package, without paying
for the report's matplotlib and scipy imports.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_MODULES = {"load_runs": "load", "load_steps": "load", "status_table": "status",
            "summary_table": "report", "write_report": "report"}
__all__ = ["load_runs", "load_steps", "status_table", "summary_table", "write_report"]

if TYPE_CHECKING:
    from .load import load_runs, load_steps
    from .report import summary_table, write_report
    from .status import status_table


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_MODULES[name]}", __name__), name)
