"""A sweep file into its trials: read it (profiles, `--set`), expand methods x search space x
seeds into trials with stable ids, the dry-run's table, the preflight and every trial's
estimate. Running them is driver.py's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.config import (
    Common,
    RunConfig,
    SweepConfig,
    memory_label,
    read_yaml,
    set_dotted,
    validate,
)
from harness.config.budget import Budget, BudgetMark
from harness.config.launchers import with_profile
from harness.config.space import check_space
from harness.config.steps import Steps
from harness.cost.estimate import estimate_run, run_shapes
from harness.distributed import pick_device
from harness.errors import UserError
from harness.methods.base import changed_params
from harness.methods.resolve import load_run, resolve_method
from harness.models import check_model, fit_vocab
from harness.trials.writable import check_writable


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
        return t.steps * Steps.of(t, self.run.task.seq_len).tokens

    @property
    def length(self) -> str:
        t = self.run.train
        return f"{t.epochs} epochs" if t.epochs else str(t.steps)

    @property
    def budget(self) -> BudgetMark | None:
        """The token budget this trial belongs to (the sweep's `budget:`), None without one."""
        return self.run.train.budget


def budgets(sweep: SweepConfig) -> list[Budget | None]:
    """The sweep's budgets in its file's order; [None] for a sweep without `budget:` (its
    trials' steps are train.steps)."""
    return list(sweep.budget.entries) if sweep.budget else [None]


def load_sweep(path: str | Path, overrides: dict[str, Any]) -> SweepConfig:
    """Read the YAML and apply `--set`s; an overridden key leaves every search space."""
    data = read_yaml(path)
    for key, value in overrides.items():
        set_dotted(data, key, value)
        methods = data.get("methods")  # any of these may be malformed: validate says so below
        owners = [data.get("search"), *(methods.values() if isinstance(methods, dict) else [])]
        for owner in owners:
            space = owner.get("space") if isinstance(owner, dict) else None
            if isinstance(space, dict):
                space.pop(key, None)
    if "launcher" in data:
        data["launcher"] = with_profile(data["launcher"], Path(path))
    sweep = validate(SweepConfig, data)
    check_model(sweep)
    return sweep


def method_entry(sweep: SweepConfig, label: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A method's registered name, its fixed parameters (checked) and its own search space;
    its `memory:` and `train:` settings are read by `make_trial`."""
    entry = dict(sweep.methods[label] or {})
    name = entry.pop("method", label)
    space = entry.pop("space", {})
    entry.pop("memory", None)
    entry.pop("train", None)
    resolve_method({"name": name, **entry}, f"methods.{label}")
    return name, entry, space


def make_trial(sweep: SweepConfig, label: str, point: dict[str, Any], seed: int,
               budget: Budget | None = None) -> Trial:
    """The resolved run for one point of a method's space, trained for `budget` (one of
    `budgets(sweep)`: required where the sweep has `budget:`); its id hashes the resolved
    config."""
    name, entry, _ = method_entry(sweep, label)
    data = {
        **sweep.model_dump(include=set(Common.model_fields), exclude_unset=True, by_alias=True),
        "name": sweep.name,
        "label": label,
        "seed": seed,
        "method": {"name": name, **entry},
    }
    for section in ("memory", "train"):  # the method's own settings win over the sweep's
        own = (sweep.methods[label] or {}).get(section) or {}
        if not isinstance(own, dict):
            raise UserError(f"methods.{label}.{section}: expected a mapping of {section} keys, "
                            f"got {own!r}")
        data[section] = {**data.get(section, {}), **own}
    for key, value in point.items():
        set_dotted(data, key, value)
    if (budget is None) != (sweep.budget is None):
        raise ValueError(f"{sweep.name}: a trial's budget is one of budgets(sweep), got {budget}")
    try:
        if budget is not None:
            data["train"] |= budget_keys(sweep, budget, data)
        run = load_run(data)
    except UserError as e:
        raise UserError(f"methods.{label} with {point}: {e}") from None
    return Trial(f"{label}-{run.identity()}", label, run, point)


def budget_keys(sweep: SweepConfig, budget: Budget, data: dict[str, Any]) -> dict[str, Any]:
    """The train keys `budget` sets in the trial `data` describes: its steps follow the trial's
    tokens per step (its batch and sequence length), a Chinchilla budget its model's size."""
    run = validate(RunConfig, data)
    params = counted_params(run, budget.params) if budget.chinchilla is not None else 0
    tokens_per_step = Steps.of(run.train, run.task.seq_len).tokens
    return budget.train_keys(params, tokens_per_step, sweep.budget.warmup)


def counted_params(run: RunConfig, which: str) -> int:
    """The parameters of the model `run` builds (before a method's adapters): all of them, or
    without the input embedding and the output head (`non_embedding`)."""
    shapes = run_shapes(run)
    total = sum(shape.numel() for shape in shapes.values())
    if which == "all":
        return total
    vocab = ("model.embed_tokens.weight", "lm_head.weight")  # lm_head absent when tied
    return total - sum(shapes[k].numel() for k in vocab if k in shapes)


def expand(sweep: SweepConfig) -> list[Trial]:
    """Grid trials; for an Optuna sampler, each method's base point (the space left unset)."""
    trials: dict[str, Trial] = {}
    for label in sweep.methods:
        _, _, own = method_entry(sweep, label)
        if sweep.search.sampler == "grid":
            space = {**sweep.search.space, **check_space(own, f"methods.{label}.space")}
        else:
            space = {}
        for budget, values in itertools.product(budgets(sweep), itertools.product(
                *space.values())):
            point = dict(zip(space, values, strict=True))
            for seed in sweep.seeds:
                trial = make_trial(sweep, label, point, seed, budget)
                trials.setdefault(trial.id, trial)
    return list(trials.values())


def plan_table(trials: list[Trial], more: dict[str, list[str]] | None = None) -> str:
    """One row per trial; `more`: further columns, header -> a cell per trial. A budget column
    where trials belong to budgets."""
    rows, budgeted = [], any(t.budget for t in trials)
    for i, t in enumerate(trials):
        changed = changed_params(t.run.method_name, t.run.method_params)
        params = {**changed, **t.point, "seed": t.run.seed}
        hp = ", ".join(f"{k}={v}" for k, v in params.items())
        memory = memory_label(t.run.memory.model_dump())
        tokens = "" if t.run.train.epochs else f"{t.tokens:,}"
        budget = [t.budget.describe() if t.budget else ""] if budgeted else []
        rows.append([t.id, t.label, hp, memory, *budget, t.length, tokens,
                     *(cells[i] for cells in (more or {}).values())])
    headers = ["trial", "method", "hyperparameters", "memory", *["budget"] * budgeted, "steps",
               "tokens", *(more or {})]
    return tabulate(rows, headers=headers, disable_numparse=True)


def preflight(sweep: SweepConfig, out: Path) -> None:
    """Fail once, before any trial starts, when trials that run on this machine ask for CUDA
    and it has none, `out` cannot be written, or (pretraining) the tokenizer or data cannot
    be reached, or the tokenizer does not fit a Hugging Face config's vocabulary."""
    from harness.data.c4 import load_tokenizer, open_documents

    if sweep.launcher.runs_here:  # a cluster's trials run on its nodes, not this one
        pick_device(sweep.device)
    check_writable(out)
    if sweep.task.kind != "pretrain":
        return
    fit_vocab(str(sweep.model), len(load_tokenizer(sweep.task.tokenizer)))
    for split in ("train", "validation"):
        open_documents(sweep.task, split)


def estimate_sweep(sweep: SweepConfig) -> list[dict[str, Any]]:
    """One record per planned trial: the method's predicted bytes, by kind and in total, on
    each of the launcher's processes (nodes x tasks_per_node)."""
    if sweep.task.kind != "pretrain":
        raise UserError("estimate: predicts pretraining presets only; a GLUE sweep's model "
                        "(an encoder or a checkpoint) is measured by running it")
    launcher = sweep.launcher  # hsdp's shard group unset: a node's tasks
    return [{"trial": t.id, "method": t.label,
             **estimate_run(t.run, launcher.ranks, local=launcher.tasks_per_node)}
            for t in expand(sweep)]
