"""Expand a sweep into trials (methods x search space x seeds) and run the unfinished ones."""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.analysis.load import memory_label
from harness.config import (
    Common,
    ModelFrom,
    RunConfig,
    UserError,
    check_model,
    load_run,
    read_yaml,
    resolve_method,
    set_dotted,
    suggest,
    validate,
)
from harness.methods.base import changed_params
from harness.records import read_json, write_yaml
from harness.space import check_space
from harness.sweep_config import LauncherConfig, SweepConfig

FINISHED = ("ok", "nan", "oom", "failed", "pruned")
FAILED = ("failed", "oom", "nan")


@dataclass
class Trial:
    id: str
    label: str
    run: RunConfig
    point: dict[str, Any]

    @property
    def tokens(self) -> int:
        """The token budget (at most, for fine-tuning: examples are shorter than seq_len)."""
        t = self.run.train
        return t.steps * (t.total_batch_size or t.batch_size) * self.run.task.seq_len

    @property
    def budget(self) -> str:
        t = self.run.train
        return f"{t.epochs} epochs" if t.epochs else str(t.steps)


def load_sweep(path: str | Path, overrides: dict[str, Any]) -> SweepConfig:
    """Read the YAML and apply `--set`s; an overridden key leaves every search space."""
    data = read_yaml(path)
    for key, value in overrides.items():
        set_dotted(data, key, value)
        spaces = [data.get("search", {}).get("space")]
        spaces += [
            m.get("space") for m in (data.get("methods") or {}).values() if isinstance(m, dict)
        ]
        for space in spaces:
            if isinstance(space, dict):
                space.pop(key, None)
    launcher = data.get("launcher")
    if isinstance(launcher, dict) and launcher.get("profile"):
        data["launcher"] = {**read_profile(launcher["profile"], Path(path)), **launcher}
    sweep = validate(SweepConfig, data)
    check_model(sweep)
    return sweep


def read_profile(name: str, sweep_path: Path) -> dict[str, Any]:
    """A named cluster profile, `slurm/<name>.yaml` beside the working or the sweep's folder;
    the sweep's own launcher keys override it."""
    places = [Path("slurm"), sweep_path.resolve().parent.parent / "slurm"]
    found = [p / f"{name}.yaml" for p in places if (p / f"{name}.yaml").is_file()]
    if not found:
        known = sorted({f.stem for p in places if p.is_dir() for f in p.glob("*.yaml")})
        raise suggest(name, known, "cluster profile", "launcher.profile")
    data = read_yaml(found[0])
    validate(LauncherConfig, data, prefix=f"{found[0]}: ")
    return data


def method_entry(sweep: SweepConfig, label: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A method's registered name, its fixed parameters (checked) and its own search space;
    its `memory:` modifiers are read by `make_trial`."""
    entry = dict(sweep.methods[label] or {})
    name = entry.pop("method", label)
    space = entry.pop("space", {})
    entry.pop("memory", None)
    resolve_method({"name": name, **entry}, f"methods.{label}")
    return name, entry, space


def make_trial(sweep: SweepConfig, label: str, point: dict[str, Any], seed: int) -> Trial:
    """The resolved run for one point of a method's space; its id hashes the resolved config."""
    name, entry, _ = method_entry(sweep, label)
    data = {
        **sweep.model_dump(include=set(Common.model_fields), exclude_unset=True, by_alias=True),
        "name": sweep.name,
        "label": label,
        "seed": seed,
        "method": {"name": name, **entry},
    }
    own = (sweep.methods[label] or {}).get("memory") or {}
    if not isinstance(own, dict):
        raise UserError(f"methods.{label}.memory: expected a mapping of memory keys, got {own!r}")
    data["memory"] = {**data.get("memory", {}), **own}  # the method's own win
    for key, value in point.items():
        set_dotted(data, key, value)
    try:
        run = load_run(data)
    except UserError as e:
        raise UserError(f"methods.{label} with {point}: {e}") from None
    return Trial(f"{label}-{run.identity()}", label, run, point)


def plan(sweep: SweepConfig) -> list[Trial]:
    """Grid trials; for an Optuna sampler, each method's base point (the space left unset)."""
    trials: dict[str, Trial] = {}
    for label in sweep.methods:
        _, _, own = method_entry(sweep, label)
        if sweep.search.sampler == "grid":
            space = {**sweep.search.space, **check_space(own, f"methods.{label}.space")}
        else:
            space = {}
        for values in itertools.product(*space.values()):
            point = dict(zip(space, values, strict=True))
            for seed in sweep.seeds:
                trial = make_trial(sweep, label, point, seed)
                trials.setdefault(trial.id, trial)
    return list(trials.values())


def trial_status(trial_dir: Path) -> str:
    """A `running` summary whose process is gone is an interrupted trial; a trial whose Slurm
    job is still queued or running is that, whatever its folder says."""
    from harness.launch import live_job

    summary = read_json(trial_dir / "summary.json")
    status = (summary or {}).get("status", "pending")
    if status in ("pending", "running", "interrupted"):
        job = live_job(trial_dir)
        if job is not None:
            return "running" if status == "running" else job
    if status == "running" and not _alive(summary):
        return "interrupted"
    return status


def _alive(summary: dict[str, Any]) -> bool:
    """Only a process on this host can be checked; one elsewhere is taken to be running."""
    if summary.get("host", socket.gethostname()) != socket.gethostname():
        return True
    pid = summary.get("pid")
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def plan_table(trials: list[Trial]) -> str:
    rows = []
    for t in trials:
        changed = changed_params(t.run.method_name, t.run.method_params)
        params = {**changed, **t.point, "seed": t.run.seed}
        hp = ", ".join(f"{k}={v}" for k, v in params.items())
        memory = memory_label(t.run.memory.model_dump())
        tokens = "" if t.run.train.epochs else f"{t.tokens:,}"
        rows.append([t.id, t.label, hp, memory, t.budget, tokens])
    headers = ["trial", "method", "hyperparameters", "memory", "steps", "tokens"]
    return tabulate(rows, headers=headers)


def preflight(sweep: SweepConfig) -> None:
    """Fail once, before any trial starts, when the tokenizer or data cannot be reached."""
    from harness.data.c4 import load_tokenizer, open_documents

    load_tokenizer(sweep.task.tokenizer)
    for split in ("train", "validation"):
        open_documents(sweep.task, split)


def run_sweep(sweep: SweepConfig, out: Path, retry_failed: bool = False) -> int:
    """Run every unfinished trial; 0 if all are ok, 1 if any failed (all are still recorded)."""
    from harness.analysis import load_runs, status_table

    pretrain_first(sweep)
    if sweep.task.kind == "pretrain":
        preflight(sweep)
    out.mkdir(parents=True, exist_ok=True)
    write_yaml(out / "sweep.yaml", sweep.model_dump())
    if sweep.search.sampler == "grid":
        failed = run_grid(sweep, out, retry_failed)
    else:
        from harness.search import run_search

        failed = run_search(sweep, out, retry_failed)
    print(status_table(load_runs(out)), flush=True)
    return 1 if failed else 0


def pretrain_first(sweep: SweepConfig) -> None:
    """Fine-tuning from a sweep's best checkpoint: run that pretraining sweep when its runs
    directory does not exist yet, so pretrain → fine-tune is one command."""
    source = sweep.model
    if not isinstance(source, ModelFrom) or not source.sweep or Path(source.from_).exists():
        return
    print(f"model.from: {source.from_} does not exist yet; running {source.sweep} first",
          flush=True)
    if run_sweep(load_sweep(source.sweep, {}), Path(source.from_)) != 0:
        raise UserError(f"model.from: the pretraining sweep {source.sweep} had failed trials "
                        f"(see {source.from_}); fix or re-run it, then this sweep")


def run_grid(sweep: SweepConfig, out: Path, retry_failed: bool) -> bool:
    """Run the plan's unfinished trials; True if any trial ended failed, oom or nan. Trials
    whose Slurm job is still queued or running are left to it (a sweep run again collects)."""
    from harness.launch import run_jobs, run_local

    trials = plan(sweep)
    skip = set(FINISHED) - (set(FAILED) if retry_failed else set())
    todo, live = [], 0
    for t in trials:
        trial_dir = out / "trials" / t.id
        status = trial_status(trial_dir)
        live += status in ("queued", "running")
        if status in skip or status in ("queued", "running"):
            continue
        write_yaml(trial_dir / "config.yaml", t.run.model_dump(by_alias=True))
        todo.append((t.id, trial_dir))
    in_slurm = f"{live} still in Slurm, " if live else ""
    print(
        f"{sweep.name}: {len(trials)} trials, {len(trials) - len(todo) - live} already "
        f"finished, {in_slurm}{len(todo)} to run in {out}",
        flush=True,
    )
    if sweep.launcher.kind == "local":
        run_local(todo, sweep.launcher.jobs)
    else:
        run_jobs(todo, sweep.launcher, out)
    return any(trial_status(out / "trials" / t.id) in FAILED for t in trials)
