"""The run folders, the only place that names their files.

    <runs>/                 RunsDir: one sweep
      sweep.yaml            the resolved sweep
      optuna.journal        an Optuna sweep's study (unless it names a database)
      jobs/                 the launcher's job logs
      report/               `harness report`'s default output
      trials/<id>/          TrialDir: one trial
        config.yaml         its resolved run config (and provenance, once it ran)
        summary.json        how it stands or ended (Summary)
        summary.json.corrupt  a summary that could not be read, moved aside by the run that
                            trained the trial again (`--retry-failed`)
        metrics.jsonl       one line per logged step, evaluation and event
        checkpoint/         what it resumes from: state.pt, the newest, and older ones
                            (checkpoints.py); removed once the final model is written, unless
                            `train.keep_final: full`
        model/              the finished trial's model in Hugging Face format, and
        model.json          its record (final_model.py)
        eval.json           its final model's downstream scores, per task (`harness eval`)
        launch.json         when and how it was launched (launcher kind, job id)
        optuna.json         the study and trial it reports to (Optuna sweeps)
        stderr.log          its stderr (local launcher)
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from harness.config import RunConfig
from harness.trials.files import (
    UnreadableFile,
    read_json,
    read_json_record,
    read_yaml_or_empty,
    write_json,
    write_yaml,
)
from harness.trials.status import Status
from harness.trials.summary import Summary

StrPath = str | os.PathLike
NEWEST = "state.pt"  # the newest checkpoint in checkpoint/ (the older: trials/checkpoints.py)


class Entry:
    """A file or folder of a run folder, by name: `folder.config` is its Path. Declared once
    here, so no other module spells the name."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    def __get__(self, folder: Folder, owner: type | None = None) -> Path:
        return folder.path.joinpath(*self.parts)


@dataclass(frozen=True)
class Folder:
    """A folder given as a path or another Folder; `os.fspath` and `str` give its path."""

    path: Path

    def __init__(self, path: StrPath) -> None:
        object.__setattr__(self, "path", Path(path))

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name


class TrialDir(Folder):
    """One trial's folder; its name is the trial's id."""

    config = Entry("config.yaml")
    summary = Entry("summary.json")
    corrupt_summary = Entry("summary.json.corrupt")
    metrics = Entry("metrics.jsonl")
    checkpoints = Entry("checkpoint")
    checkpoint = Entry("checkpoint", NEWEST)
    final_model = Entry("model")
    launch = Entry("launch.json")
    optuna_link = Entry("optuna.json")
    stderr = Entry("stderr.log")
    downstream = Entry("eval.json")

    def is_trial(self) -> bool:
        """A folder holding a run config: what `model.from` may name directly."""
        return self.config.is_file()

    def write_config(self, run: RunConfig, provenance: dict[str, Any] | None = None) -> None:
        """The resolved run config, as `harness train` reads it back."""
        data = run.model_dump(by_alias=True)
        if provenance is not None:
            data["provenance"] = provenance
        write_yaml(self.config, data)

    def read_config(self) -> dict[str, Any]:
        """The config as written, {} for a trial not yet written (never raises)."""
        return read_yaml_or_empty(self.config)

    def read_summary(self) -> Summary | None:
        """None for a trial without a summary yet. A summary.json that is there but cannot be
        read (not JSON, not an object, no `status`) is never taken for that: it is status
        `unreadable`, its `error` the file and why. Such a summary is never written back."""
        try:
            data = read_json_record(self.summary)
        except UnreadableFile as e:
            return self._unreadable(str(e))
        if data is None:
            return None
        if not isinstance(data.get("status"), str):
            status = data.get("status")
            why = "no status" if status is None else f"status {status!r} is not a string"
            return self._unreadable(f"{self.summary}: {why}")
        return Summary.parse(data)

    def _unreadable(self, error: str) -> Summary:
        return Summary(trial=self.name, status=Status.UNREADABLE, error=error)

    def set_aside_summary(self) -> Path:
        """Move a summary that cannot be read out of the way of a new one, kept for a look."""
        os.replace(self.summary, self.corrupt_summary)
        return self.corrupt_summary

    def write_summary(self, summary: Summary | dict[str, Any]) -> None:
        write_json(self.summary, summary.to_dict() if isinstance(summary, Summary) else summary)

    def mark_end(self, status: Status, error: str) -> None:
        """Record an end the trial could not record itself (failed, killed, oom) with its
        reason; a final status already written (ok, interrupted, failed, ...) came first and
        is left as it is. A summary that cannot be read is moved aside for this one."""
        summary = self.read_summary() or Summary.parse({"trial": self.name})
        if summary.status == Status.UNREADABLE:
            self.set_aside_summary()
            summary = Summary.parse({"trial": self.name})
        if summary.get("status") in (None, Status.PENDING, Status.RUNNING):
            self.write_summary(summary.update(status=status, error=error))

    def record_crash(self, code: int) -> None:
        """A child that died without its final summary (killed, segfault) ends `failed`."""
        if code != 0:
            reason = f"signal {-code}" if code < 0 else f"exit code {code}"
            self.mark_end(Status.FAILED, f"trial process ended with {reason}")

    def count_requeue(self) -> None:
        """One more preemption or time limit survived (the trial's job was requeued)."""
        summary = self.read_summary()
        if summary is not None and summary.status != Status.UNREADABLE:
            self.write_summary(summary.update(requeues=summary.get("requeues", 0) + 1))

    def record_launch(self, launcher: str, job_id: str | None = None) -> None:
        """When and how a trial was launched: `harness status` asks the launcher's cluster
        about a job that may still be queued."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(
            self.launch,
            {"launcher": launcher, "job_id": job_id, "host": socket.gethostname(),
             "submitted_at": time.time()},
        )

    def read_launch(self) -> dict[str, Any]:
        """{} for a trial never launched by a sweep (or whose record is half-written)."""
        return read_json(self.launch) or {}

    def write_optuna_link(self, link: dict[str, Any]) -> None:
        """Where the trial reports its evaluations: storage, study, trial number, metric."""
        write_json(self.optuna_link, link)

    def open_stderr(self) -> IO[str]:
        """The trial's stderr log, appended to across launches."""
        self.path.mkdir(parents=True, exist_ok=True)
        return self.stderr.open("a")


class RunsDir(Folder):
    """One sweep's folder: its resolved sweep, its trials, its study journal, job logs."""

    sweep_yaml = Entry("sweep.yaml")
    trials = Entry("trials")
    journal = Entry("optuna.journal")
    jobs = Entry("jobs")
    report = Entry("report")
    lock = Entry("sweep.lock")  # the sweep process that owns the folder (harness/sweep/run/lock.py)

    def trial(self, trial_id: str) -> TrialDir:
        return TrialDir(self.trials / str(trial_id))

    def trial_dirs(self) -> list[TrialDir]:
        """Every trial folder, t2 before t10; [] where no trial has been written."""
        if not self.trials.is_dir():
            return []
        found = [TrialDir(p) for p in self.trials.iterdir() if p.is_dir()]
        return sorted(found, key=lambda t: natural_key(t.name))

    def is_runs_dir(self) -> bool:
        return self.trials.is_dir()

    def write_sweep(self, sweep: dict[str, Any]) -> None:
        write_yaml(self.sweep_yaml, sweep)

    def read_sweep(self) -> dict[str, Any]:
        """The resolved sweep, or {} for a single run that has none."""
        return read_yaml_or_empty(self.sweep_yaml)


def natural_key(name: str) -> list[int | str]:
    """Sort trial ids so that t2 comes before t10."""
    parts = re.split(r"([0-9]+)", name)
    return [int(part) if i % 2 else part for i, part in enumerate(parts)]
