"""The sweep's `tuning:` made concrete for each method: its ladders (the learning rates of
`tuning.lr` and the values of each setting its config marks tunable), and, for the grid and
Optuna procedures, the sweep those searches run (coordinate descent: coordinate.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.config import SearchConfig, SweepConfig
from harness.config.tuning import tunables
from harness.errors import UserError
from harness.methods.base import get_method
from harness.sweep.plan.expand import method_entry

LR_KEY = "train.lr"


@dataclass(frozen=True)
class Ladder:
    """One tuned setting: its dotted run key, its values in ladder order, where it starts."""

    key: str
    values: list[Any]
    start: int


def method_lr(sweep: SweepConfig, label: str) -> float:
    """The method's own train.lr in the sweep file, else the sweep's."""
    own = (sweep.methods[label] or {}).get("train") or {}
    return float(own.get("lr", sweep.train.lr))


def ladders(sweep: SweepConfig, label: str) -> list[Ladder]:
    """The LR ladder, starting at the LR nearest (in log) to the method's train.lr, then each
    tunable setting at its default; a setting the method's entry fixes is not tuned, nor is any
    under the grid procedure (LR only)."""
    tuning = sweep.tuning
    assert tuning is not None
    lr = method_lr(sweep, label)
    start = min(range(len(tuning.lr)), key=lambda i: abs(math.log(tuning.lr[i] / lr)))
    out = [Ladder(LR_KEY, list(tuning.lr), start)]
    if tuning.procedure == "grid":
        return out
    name, fixed, _ = method_entry(sweep, label)
    config = get_method(name).Config
    for field, values in tunables(config).items():
        if field not in fixed:
            default = config.model_fields[field].get_default(call_default_factory=True)
            out.append(Ladder(f"method.{field}", values, values.index(default)))
    return out


def configurations(steps: list[Ladder]) -> int:
    return math.prod(len(s.values) for s in steps)


def check_tuning(sweep: SweepConfig) -> None:
    """Every method can get `tuning.trials` distinct configurations (so each gets the same
    count), and Optuna's study (one per method) spans one budget."""
    tuning = sweep.tuning
    assert tuning is not None
    if tuning.procedure == "optuna" and sweep.budget is not None:
        raise UserError("tuning.procedure: optuna with budget: (its study, one per method, "
                        "spans one budget); allowed: coordinate or grid, or a sweep per budget")
    if tuning.procedure != "coordinate":
        return
    for label in sweep.methods:
        steps = ladders(sweep, label)
        if configurations(steps) < (tuning.trials or 0):
            shape = " x ".join(f"{len(s.values)} {s.key}" for s in steps)
            raise UserError(f"tuning.trials: {tuning.trials} is more than methods.{label}'s "
                            f"{configurations(steps)} configurations ({shape}); allowed: at "
                            f"most {configurations(steps)}, or more values in tuning.lr")


def optuna_value(value: Any) -> Any:
    """Optuna stores a categorical's choices as JSON: a tuple setting goes in as a list, which
    the run config reads back as the tuple."""
    return list(value) if isinstance(value, tuple) else value


def searched(sweep: SweepConfig) -> SweepConfig:
    """The sweep the grid or Optuna procedure runs: grid, every LR of `tuning.lr`; optuna,
    TPE over the LR range (log) and each method's tunable settings, `tuning.trials` a
    method."""
    tuning = sweep.tuning
    assert tuning is not None and tuning.procedure != "coordinate"
    s = sweep.search
    goal = {"metric": s.metric, "direction": s.direction}
    if tuning.procedure == "grid":
        search = SearchConfig(sampler="grid", space={LR_KEY: list(tuning.lr)}, **goal)
        return sweep.model_copy(update={"search": search})
    search = SearchConfig(sampler="tpe", n_trials=tuning.trials, **goal)
    methods = {}
    for label, entry in sweep.methods.items():
        space: dict[str, Any] = {LR_KEY: {"low": tuning.lr[0], "high": tuning.lr[-1], "log": True}}
        for step in ladders(sweep, label)[1:]:
            space[step.key] = [optuna_value(v) for v in step.values]
        methods[label] = {**(entry or {}), "space": space}
    return sweep.model_copy(update={"search": search, "methods": methods})
