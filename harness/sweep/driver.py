"""Run a sweep: its unfinished trials, on the launcher it names. A grid hands its trials to
the workers as a fixed list, a search asks Optuna; both run through `launch`. A trial left
interrupted with a checkpoint (a preemption its job could not survive) runs again before the
sweep ends, and a sweep that still has unfinished trials says so in its exit code."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from harness.config import ModelFrom, SweepConfig
from harness.errors import UserError
from harness.sweep.expand import expand, load_sweep, preflight
from harness.sweep.forecast import check_disk
from harness.sweep.launchers.launch import launch
from harness.sweep.lock import hold
from harness.sweep.source import GridSource
from harness.sweep.study_source import (
    StudySource,
    open_studies,
    recover_studies,
    studies_failed,
)
from harness.sweep.trial_state import trial_statuses
from harness.trials import FAILED, FINISHED, RunsDir, Status, TrialDir

Show = Callable[[Path], None]  # prints a finished sweep's table (the CLI's, from analysis)
UNFINISHED = 3  # run_sweep's code for a sweep that ended with trials still to run


def run_sweep(sweep: SweepConfig, out: Path, retry_failed: bool = False,
              show: Show | None = None) -> int:
    """Run every unfinished trial; 0 if all are ok, 1 if any failed (all are still recorded),
    UNFINISHED if some trial is still unfinished (`unfinished` names them). `show` is called
    on the runs directory at the end (the sweep room sits below analysis)."""
    preflight(sweep, out)
    if sweep.task.kind == "pretrain":
        check_disk(sweep, out, retry_failed)
    out.mkdir(parents=True, exist_ok=True)
    with nullcontext() if shares_study(sweep) else hold(out):
        pretrain_first(sweep, show)
        RunsDir(out).write_sweep(sweep.model_dump())
        if sweep.search.sampler == "grid":
            any_failed = run_grid(sweep, out, retry_failed)
        else:
            any_failed = run_search(sweep, out, retry_failed)
    if show is not None:
        show(out)
    if unfinished(sweep, out):
        return UNFINISHED
    return 1 if any_failed else 0


def shares_study(sweep: SweepConfig) -> bool:
    """A search whose study is in a database: the documented way for several sweep processes
    to work one runs folder (the study hands each trial to one of them), so it takes no lock."""
    return sweep.search.sampler != "grid" and "://" in (sweep.storage or "")


def unfinished(sweep: SweepConfig, out: Path) -> list[tuple[TrialDir, str]]:
    """The sweep's trials without an end, each with its status (interrupted, queued, ...)."""
    dirs = _trial_dirs(sweep, out)
    return [(d, s) for d, s in zip(dirs, trial_statuses(dirs), strict=True) if s not in FINISHED]


def failed(sweep: SweepConfig, out: Path) -> list[TrialDir]:
    """The sweep's trials that ended failed, oom, nan or killed: `--retry-failed` runs them."""
    dirs = _trial_dirs(sweep, out)
    return [d for d, s in zip(dirs, trial_statuses(dirs), strict=True) if s in FAILED]


def _trial_dirs(sweep: SweepConfig, out: Path) -> list[TrialDir]:
    """A grid's planned trials; a search's, those it has asked for."""
    if sweep.search.sampler == "grid":
        return [RunsDir(out).trial(t.id) for t in expand(sweep)]
    return RunsDir(out).trial_dirs()


def resubmit(sweep: SweepConfig, trials: Callable[[], list[TrialDir]],
             relaunch: Callable[[list[TrialDir]], None]) -> None:
    """Trials left interrupted with a checkpoint (a preemption their job could not survive, a
    trial stopped by a signal) run again, each resubmission a requeue, at most
    `launcher.max_requeues` times, before the sweep ends."""
    limit = sweep.launcher.max_requeues
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


def pretrain_first(sweep: SweepConfig, show: Show | None = None) -> None:
    """Fine-tuning from a sweep's best checkpoint: run that pretraining sweep when its runs
    directory does not exist yet, so pretrain → fine-tune is one command."""
    source = sweep.model
    if not isinstance(source, ModelFrom) or not source.sweep or Path(source.from_).exists():
        return
    print(f"model.from: {source.from_} does not exist yet; running {source.sweep} first",
          flush=True)
    if run_sweep(load_sweep(source.sweep, {}), Path(source.from_), show=show) != 0:
        raise UserError(f"model.from: the pretraining sweep {source.sweep} had failed trials "
                        f"(see {source.from_}); fix or re-run it, then this sweep")


def run_grid(sweep: SweepConfig, out: Path, retry_failed: bool) -> bool:
    """Run the plan's unfinished trials; True if any trial ended failed, oom, nan or killed.
    Trials whose Slurm job is still queued or running are left to it (a sweep run again
    collects)."""
    source, dirs, live, ended_failed = GridSource.unfinished(sweep, out, retry_failed)
    in_slurm = f"{live} still in Slurm, " if live else ""
    retry = (f"; {ended_failed} of them failed (run them again with --retry-failed)"
             if ended_failed else "")
    print(
        f"{sweep.name}: {len(dirs)} trials, {len(dirs) - len(source) - live} already "
        f"finished, {in_slurm}{len(source)} to run in {out}{retry}",
        flush=True,
    )
    launch(source.split(), sweep.launcher, out, total=len(source))
    resubmit(sweep, lambda: dirs, lambda again: launch(
        GridSource([(d.name, d.path) for d in again]).split(), sweep.launcher, out, len(again)))
    return any(status in FAILED for status in trial_statuses(dirs))


def run_search(sweep: SweepConfig, out: Path, retry_failed: bool = False) -> bool:
    """Run each method's study to `n_trials` with `jobs` workers; True if some trial failed
    (pruned is fine). Interrupted trials are queued again in their study, and the workers
    started again, as `resubmit` says."""
    storage = open_studies(sweep, out, retry_failed)
    lock = threading.Lock()  # local workers check the budget and ask as one step

    def workers() -> None:
        launch([StudySource(sweep, out, i, lock) for i in range(sweep.launcher.jobs)],
               sweep.launcher, out)

    def again(_: list[TrialDir]) -> None:
        recover_studies(sweep, out, storage)
        workers()

    workers()
    resubmit(sweep, RunsDir(out).trial_dirs, again)
    return studies_failed(sweep, storage)
