"""`harness sweep`: read the sweep file and its `--set`s, then print its plan (`--dry-run`) or
run it (harness/sweep/run/driver.py `run_and_report`); and the outcome table a finished sweep
prints, which reads the analysis room, above the sweep's."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from harness.cli_args import EXIT_INTERRUPTED, EXIT_OK
from harness.errors import UserError

# Only the command line is imported here: `harness --help` stays light; the sweep's rooms
# (torch, transformers, pandas) are imported as the command runs.


def cmd_sweep(args: argparse.Namespace) -> int:
    from harness.config import parse_overrides
    from harness.sweep.plan.expand import load_sweep
    from harness.sweep.run.driver import run_and_report
    from harness.sweep.search.open import open_search

    sweep = load_sweep(args.sweep, parse_overrides(args.set))
    out = Path(args.out) if args.out else Path("runs") / sweep.name
    if args.dry_run:  # the plan offline: a grid's trials (their cost), a search's studies
        print(open_search(sweep, out).describe())
        return EXIT_OK
    if args.jobs:
        sweep.launcher.jobs = args.jobs
    resume = shlex.join(["harness", "sweep", args.sweep, "--out", str(out),
                         *[a for s in args.set for a in ("--set", s)],
                         *(["--jobs", str(args.jobs)] if args.jobs else [])])
    try:
        return run_and_report(sweep, out, args.retry_failed, resume, show=show_outcome)
    except KeyboardInterrupt:  # the trials stopped and the resume command are said
        return EXIT_INTERRUPTED


def show_outcome(out: Path) -> None:
    """A finished sweep's trials counted by status, each one that did not end ok named with its
    error, and where the tables are: the per-trial table is `harness status`'s and the results
    `harness report`'s, so `harness sweep X && harness report X` prints each table once."""
    from harness.trials import FAILED, Status

    trials = load_trials(str(out))
    counts = trials["status"].value_counts()
    order = [Status.OK, *(s for s in Status if s != Status.OK)]
    outcome = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    where, n = shlex.quote(str(out)), len(trials)
    print(f"{n} trial{'' if n == 1 else 's'} in {out}: {outcome or 'none'} (one row each: "
          f"harness status {where}; tables and figures: harness report {where})", flush=True)
    for _, row in trials[trials["status"].isin(FAILED)].iterrows():  # unfinished: cmd_sweep's
        error = f": {row['error']}" if isinstance(row.get("error"), str) else ""
        print(f"  {row['trial']} {row['status']}{error}", flush=True)


def load_trials(runs_dir: str) -> Any:
    """A runs folder's trials, each with its live status (its job's, a dead process's)."""
    from harness.analysis import load_runs
    from harness.sweep.run.trial_state import trial_statuses
    from harness.trials import RunsDir

    try:
        trials = load_runs(runs_dir)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    if len(trials):  # one query per launcher for all of them
        trials["status"] = trial_statuses([
            RunsDir(d).trial(t) for d, t in zip(trials["run_dir"], trials["trial"], strict=True)
        ])
    return trials
