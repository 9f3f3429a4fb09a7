"""Typed configs of a sweep: its search and the sweep file itself (where its trials run:
harness/config/launchers/)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from harness.config.budget import BudgetConfig, check_budget_sweep
from harness.config.launchers import AnyLauncher, LocalConfig, process_kinds
from harness.config.objectives import Constraint, EvaluatedName, Objective
from harness.config.run import Common, Strict
from harness.config.space import check_distributions, check_space
from harness.config.tuning import TuningConfig
from harness.errors import UserError


class SearchConfig(Strict):
    sampler: Literal["grid", "random", "tpe", "cmaes", "nsga2"] = Field(
        "grid", description="tpe searches one or several objectives; nsga2 several (NSGA-II)")
    space: dict[str, Any] = Field(
        default_factory=dict,
        description="grid: dotted key -> list of values; other samplers: key -> distribution",
    )
    metric: EvaluatedName = Field(
        "eval_ppl", description="eval_score: a GLUE task's score (maximize)"
    )
    direction: Literal["minimize", "maximize"] = "minimize"
    objectives: list[Objective] = Field(
        default_factory=list, description="several {metric, direction}: a multi-objective "
        "study (its Pareto front in the report); none: metric and direction")
    constraints: list[str] = Field(
        default_factory=list, description="e.g. 'peak_memory_bytes <= 24GB': each trial's "
        "margin is recorded and the sampler prefers trials that meet them")
    n_trials: int | None = Field(None, ge=1, description="Optuna trials per method")
    timeout_min: float | None = Field(None, gt=0, description="stop asking new trials after this")
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list, description="fixed points each method's study tries first"
    )
    pruner: Literal["none", "median", "hyperband"] = "none"
    heartbeat_s: int = Field(
        60, ge=1, description="database storage: a trial silent 3x this long is retried"
    )

    @property
    def goals(self) -> list[Objective]:
        """What the study optimizes: `objectives`, or the one `metric` and `direction`."""
        return self.objectives or [Objective(metric=self.metric, direction=self.direction)]

    @property
    def limits(self) -> list[Constraint]:
        return [Constraint.parse(c, f"search.constraints[{i}]")
                for i, c in enumerate(self.constraints)]

    @model_validator(mode="after")
    def _fits_objectives(self) -> SearchConfig:
        self.limits  # noqa: B018  (each constraint parses, or its one-line error)
        if len(self.goals) > 1 and self.pruner != "none":
            raise ValueError(f"pruner {self.pruner!r} needs one objective: Optuna cannot prune a "
                             "multi-objective study (use pruner: none)")
        if len(self.goals) > 1 and self.sampler == "cmaes":
            raise ValueError("sampler 'cmaes' searches one objective; with several use tpe or "
                             "nsga2")
        return self

    @model_validator(mode="after")
    def _fits_sampler(self) -> SearchConfig:
        if self.sampler == "grid":
            extra = [k for k in ("n_trials", "timeout_min") if getattr(self, k) is not None]
            extra += ["enqueue"] * bool(self.enqueue) + ["pruner"] * (self.pruner != "none")
            if extra:
                raise ValueError(
                    f"{extra[0]} needs an Optuna sampler (random, tpe, cmaes, nsga2), not grid"
                )
            check_space(self.space, "search.space")
        elif self.n_trials is None:
            raise ValueError(
                f"n_trials is required for sampler '{self.sampler}' "
                "(the number of trials per method)"
            )
        else:
            check_distributions(self.space, "search.space")
        return self


class SweepConfig(Common):
    name: str
    note: str | None = Field(
        None, description="what the sweep's numbers can and cannot say: the report opens with it"
    )
    methods: dict[str, dict[str, Any]] = Field(min_length=1)
    search: SearchConfig = Field(default_factory=SearchConfig)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    launcher: AnyLauncher = Field(default_factory=LocalConfig)  # type: ignore[valid-type]
    storage: str | None = Field(
        None, description="Optuna storage: a journal file path or a database URL"
    )
    tuning: TuningConfig | None = Field(
        None, description="the same tuning for every method: {procedure: grid|optuna|"
        "coordinate, trials: N, lr: [...]} tunes each method's LR and its tunable settings")
    keep_models: Literal["best", "all", "none"] = Field(
        "best", description="as each run of the sweep ends: which trials that ended ok keep "
        "their final model (best: each method's best by the search metric per model and "
        "budget; all; none)"
    )
    budget: BudgetConfig | None = Field(
        None, description="token budgets, each trained for by every method: {tokens: [...]} or "
        "{chinchilla: [...], params: all|non_embedding}; steps and warmup follow each")

    @model_validator(mode="before")
    @classmethod
    def _budget_sets_steps(cls, data: Any) -> Any:
        """A budget decides each trial's steps and warmup: the file may not set them too."""
        if isinstance(data, dict) and data.get("budget") is not None:
            check_budget_sweep(data)
        return data

    @field_validator("methods")
    @classmethod
    def _method_names(cls, methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """`method:` names the registered method of a labelled entry (registry checks it)."""
        for label, entry in methods.items():
            name = entry.get("method", label)
            if not isinstance(name, str):
                raise UserError(f"methods.{label}.method: {name!r} is not a method name (a "
                                "registered method; see `harness methods`)")
        return methods

    @model_validator(mode="after")
    def _tuning_owns_spaces(self) -> SweepConfig:
        """`tuning:` makes each method's space: a space or sampler of the file's own would be
        a second, different tuning."""
        if self.tuning is None:
            return self
        s = self.search
        extra = (["search.space"] * bool(s.space) + ["search.sampler"] * (s.sampler != "grid")
                 + [f"methods.{label}.space" for label, entry in self.methods.items()
                    if isinstance(entry, dict) and entry.get("space")])
        if extra:
            raise UserError(f"{extra[0]}: not allowed with tuning:, which makes every method's "
                            "space from tuning.lr and the method's tunable settings (remove "
                            f"{extra[0]}, or tuning:)")
        if len(s.goals) > 1:
            raise UserError("search.objectives: tuning: minimizes one metric (allowed: "
                            "search.metric and search.direction)")
        if self.tuning.procedure == "coordinate" and self.launcher.kind != "local":
            raise UserError(f"launcher.kind: {self.launcher.kind!r} with tuning.procedure "
                            "coordinate, whose proposals wait on results in the sweep process "
                            "(allowed: local; or procedure grid or optuna)")
        return self

    @model_validator(mode="after")
    def _launcher_fits(self) -> SweepConfig:
        if self.launcher.ranks > 1 and not self.launcher.processes:
            raise ValueError(
                "launcher: nodes x tasks_per_node > 1 (a DDP trial) needs kind "
                f"{' or '.join(process_kinds())} (or run `torchrun ... harness train`)"
            )
        return self
