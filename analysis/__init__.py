"""Read sweep results from run directories and report them.

`load_runs` / `load_steps` turn a RUNS_DIR (or several) into pandas tables; `summary_table`
compares methods at their own best learning rate; `status_table` is what `harness status`
prints; `write_report` writes report.html, report.md, the tables and the figures under
RUNS_DIR/report/.
"""

from .load import load_runs, load_steps
from .report import status_table, summary_table, write_report

__all__ = ["load_runs", "load_steps", "status_table", "summary_table", "write_report"]
