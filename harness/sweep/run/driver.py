"""Run a sweep: its unfinished trials, on the launcher it names. The sweep's search (a grid or
an Optuna study, search.py) gives the worker sources and the run part launches them, never
knowing which kind they are. A trial left interrupted with a checkpoint (a preemption its job
could not survive) runs again before the sweep ends, and a sweep that still has unfinished
trials says so in its exit code. As it ends, the trials that are not worth it drop their final
models (`keep_models`, keep.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from harness.config import ModelFrom, SweepConfig
from harness.errors import UserError
from harness.sweep.launchers.launch import check_launcher, launch
from harness.sweep.plan.expand import load_sweep, preflight
from harness.sweep.plan.forecast import check_disk
from harness.sweep.run.keep import keep_models
from harness.sweep.run.lock import hold
from harness.sweep.run.stop import signal_name, stop_on_signals
from harness.sweep.run.trial_state import trial_statuses
from harness.sweep.search.open import open_search
from harness.sweep.search.source import Search, Work
from harness.trials import FAILED, FINISHED, RunsDir, Status, TrialDir

Show = Callable[[Path], None]  # prints a finished sweep's table (the CLI's, from analysis)
SOME_FAILED = 1  # run_sweep's code for a sweep whose trials all ended, some not ok
UNFINISHED = 3  # run_sweep's code for a sweep that ended with trials still to run


def run_sweep(sweep: SweepConfig, out: Path, retry_failed: bool = False,
              show: Show | None = None) -> int:
    """Run every unfinished trial; 0 if all are ok, SOME_FAILED if any failed (all are still
    recorded), UNFINISHED if some trial is still unfinished (`unfinished` names them). `show`
    is called on the runs directory at the end (the sweep room sits below analysis)."""
    return run(open_search(sweep, out), retry_failed, show)


def run(search: Search, retry_failed: bool = False, show: Show | None = None) -> int:
    """`run_sweep` on the sweep's search, made once for the run."""
    sweep, out = search.sweep, search.out
    check_launcher(sweep.launcher)  # a launcher that cannot run here answers before the data
    preflight(sweep, out)
    if sweep.task.kind == "pretrain":
        check_disk(sweep.launcher, search.left(retry_failed), out)
    out.mkdir(parents=True, exist_ok=True)
    with nullcontext() if search.shared else hold(out):
        pretrain_first(sweep.model, show)
        RunsDir(out).write_sweep(sweep.model_dump())
        work(search, search.start(retry_failed))
        resubmit(sweep.launcher.max_requeues, search.trial_dirs,
                 lambda again: work(search, search.again(again)))
        any_failed = search.failed()
        if dropped := keep_models(sweep, search.trial_dirs()):
            print(dropped, flush=True)
    if show is not None:
        show(out)
    if unfinished(search):
        return UNFINISHED
    return SOME_FAILED if any_failed else 0


def work(search: Search, todo: Work) -> None:
    launch(todo.sources, search.sweep.launcher, search.out, total=todo.total)


def run_and_report(sweep: SweepConfig, out: Path, retry_failed: bool, resume: str,
                   show: Show | None = None) -> int:
    """`harness sweep`: run it, stopping as Ctrl-C does on any stop signal, and say how it
    ended on stderr: each unfinished trial, or each trial stopped with a checkpoint, with
    `resume`, the command that resumes the sweep. A stop raises KeyboardInterrupt on, once
    said."""
    search = open_search(sweep, out)
    try:
        with stop_on_signals():  # SIGTERM, SIGHUP and SIGUSR2 stop it as Ctrl-C does
            code = run(search, retry_failed, show)
    except KeyboardInterrupt as stop:
        saved = [f"{t.name} at step {step_of(t)}"
                 for t, status in unfinished(search) if status == Status.INTERRUPTED]
        stopped = (f": {len(saved)} trials stopped with a checkpoint ({', '.join(saved)})"
                   if saved else "")
        print(f"\ninterrupted by {signal_name(stop)}{stopped}; resume: {resume}", file=sys.stderr)
        raise
    if code == UNFINISHED:  # never a success while a trial has not ended: name each one
        for trial, status in unfinished(search):
            at = f" at step {step}" if (step := step_of(trial)) else ""
            print(f"unfinished: {trial.name} ({status}{at}); resume: {resume}", file=sys.stderr)
    if code == SOME_FAILED:
        print(f"{len(failed(search))} trials failed; run them again: {resume} --retry-failed",
              file=sys.stderr)
    return code


def step_of(trial: TrialDir) -> int:
    """The step a trial's summary says it reached (0 before its first)."""
    return int((trial.read_summary() or {}).get("step") or 0)


def unfinished(search: Search) -> list[tuple[TrialDir, str]]:
    """The sweep's trials without an end, each with its status (interrupted, queued, ...)."""
    dirs = search.trial_dirs()
    return [(d, s) for d, s in zip(dirs, trial_statuses(dirs), strict=True) if s not in FINISHED]


def failed(search: Search) -> list[TrialDir]:
    """The sweep's trials that ended failed, oom, nan or killed: `--retry-failed` runs them."""
    dirs = search.trial_dirs()
    return [d for d, s in zip(dirs, trial_statuses(dirs), strict=True) if s in FAILED]


def resubmit(limit: int, trials: Callable[[], list[TrialDir]],
             relaunch: Callable[[list[TrialDir]], None]) -> None:
    """Trials left interrupted with a checkpoint (a preemption their job could not survive, a
    trial stopped by a signal) run again, each resubmission a requeue, at most `limit`
    (`launcher.max_requeues`) times, before the sweep ends."""
    for n in range(1, limit + 1):
        dirs = trials()
        again = [d for d, s in zip(dirs, trial_statuses(dirs), strict=True)
                 if s == Status.INTERRUPTED and has_checkpoint(d)]
        if not again:
            return
        print(f"{len(again)} trials interrupted with a checkpoint: resubmitting them "
              f"({n} of at most {limit})", flush=True)
        for trial in again:
            trial.count_requeue()
        relaunch(again)


def has_checkpoint(trial: TrialDir) -> bool:
    """Any file in the trial's checkpoint folder: the trial resumes from the newest one."""
    folder = trial.checkpoint.parent
    return folder.is_dir() and any(p.is_file() for p in folder.rglob("*"))


def pretrain_first(source: str | ModelFrom, show: Show | None = None) -> None:
    """Fine-tuning from a sweep's best checkpoint (`model:`): run that pretraining sweep when
    its runs directory does not exist yet, so pretrain → fine-tune is one command."""
    if not isinstance(source, ModelFrom) or not source.sweep or Path(source.from_).exists():
        return
    print(f"model.from: {source.from_} does not exist yet; running {source.sweep} first",
          flush=True)
    if run_sweep(load_sweep(source.sweep, {}), Path(source.from_), show=show) != 0:
        raise UserError(f"model.from: the pretraining sweep {source.sweep} had failed trials "
                        f"(see {source.from_}); fix or re-run it, then this sweep")
