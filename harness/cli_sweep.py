"""`harness sweep`: run a sweep file's unfinished trials, stopping as Ctrl-C does on any stop
signal, and say how it ended (each unfinished trial with the command that resumes it)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from harness.cli_args import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from harness.errors import UserError

# Only the command line is imported here: `harness --help` stays light; the sweep's rooms
# (torch, transformers, pandas) are imported as the command runs.


def cmd_sweep(args: argparse.Namespace) -> int:
    from harness.config import parse_overrides
    from harness.sweep.driver import UNFINISHED, failed, run_sweep, unfinished
    from harness.sweep.expand import load_sweep
    from harness.sweep.stop import signal_name, stop_on_signals
    from harness.trials import Status

    sweep = load_sweep(args.sweep, parse_overrides(args.set))
    out = Path(args.out) if args.out else Path("runs") / sweep.name
    if args.dry_run:
        return dry_run(sweep, out)
    resume = shlex.join(["harness", "sweep", args.sweep, "--out", str(out),
                         *[a for s in args.set for a in ("--set", s)],
                         *(["--jobs", str(args.jobs)] if args.jobs else [])])
    try:
        if args.jobs:
            sweep.launcher.jobs = args.jobs
        with stop_on_signals():  # SIGTERM, SIGHUP and SIGUSR2 stop it as Ctrl-C does
            code = run_sweep(sweep, out, args.retry_failed, show=show_outcome)
        if code == UNFINISHED:  # never a success while a trial has not ended: name each one
            for trial, status in unfinished(sweep, out):
                at = f" at step {step}" if (step := _step(trial)) else ""
                print(f"unfinished: {trial.name} ({status}{at}); resume: {resume}",
                      file=sys.stderr)
        if code == EXIT_FAILED:
            print(f"{len(failed(sweep, out))} trials failed; run them again: {resume} "
                  "--retry-failed", file=sys.stderr)
        return code
    except KeyboardInterrupt as stop:
        saved = [f"{t.name} at step {_step(t)}"
                 for t, status in unfinished(sweep, out) if status == Status.INTERRUPTED]
        stopped = (f": {len(saved)} trials stopped with a checkpoint ({', '.join(saved)})"
                   if saved else "")
        print(f"\ninterrupted by {signal_name(stop)}{stopped}; resume: {resume}", file=sys.stderr)
        return EXIT_INTERRUPTED


def dry_run(sweep: Any, out: Path) -> int:
    """The plan offline: a search's studies described; a grid's trials, and for pretraining
    what each will cost (peak, device time, disk) and the totals."""
    from harness.sweep.expand import expand, plan_table

    if sweep.search.sampler != "grid":
        from harness.sweep.study import describe

        print(describe(sweep))
        return EXIT_OK
    trials = expand(sweep)
    tokens = sum(t.tokens for t in trials if not t.run.train.epochs)
    if sweep.task.kind != "pretrain":  # a GLUE model is measured by running it
        print(f"{plan_table(trials)}\n{len(trials)} trials")
        return EXIT_OK
    from harness.sweep.forecast import forecast, forecast_columns, forecast_totals

    records = forecast(sweep, trials, out)
    print(f"{plan_table(trials, forecast_columns(records))}\n"
          f"{forecast_totals(records, tokens, sweep.launcher.at_once)}")
    return EXIT_OK


def _step(trial: Any) -> int:
    """The step a trial's summary says it reached (0 before its first)."""
    return int((trial.read_summary() or {}).get("step") or 0)


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
    """A runs folder's trials, each with its live status (Slurm's, a dead process's)."""
    from harness.analysis import load_runs
    from harness.sweep.trial_state import trial_statuses
    from harness.trials import RunsDir

    try:
        trials = load_runs(runs_dir)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    if len(trials):  # one squeue for all of them
        trials["status"] = trial_statuses([
            RunsDir(d).trial(t) for d, t in zip(trials["run_dir"], trials["trial"], strict=True)
        ])
    return trials
