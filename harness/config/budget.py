"""Token budgets: a sweep's `budget:` key (tokens, or multiples of Chinchilla's 20 tokens per
parameter), what each trial records of its budget (`train.budget`), and the arithmetic that
turns a budget into optimizer steps and warmup (harness/sweep/plan/expand.py applies it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from harness.config.strict import Strict
from harness.errors import UserError

TOKENS_PER_PARAM = 20  # Hoffmann et al. (2022): compute-optimal tokens per parameter
Counted = Literal["all", "non_embedding"]
Tokens = Annotated[int, Field(ge=1)]
Multiple = Annotated[float, Field(gt=0, allow_inf_nan=False)]
SET_BY_BUDGET = ("steps", "warmup_steps", "epochs")  # train keys a budget decides (or forbids)


class BudgetConfig(Strict):
    """The sweep's `budget:`: each entry a budget every method's trials train for."""

    tokens: list[Tokens] | None = Field(
        None, description="token budgets, each trained for by every method (e.g. [1.0e7, 4.0e7])")
    chinchilla: list[Multiple] | None = Field(
        None, description="budgets as multiples of 20 tokens per parameter (e.g. [1, 2, 4, 8])")
    params: Counted = Field(
        "all", description="chinchilla: the parameters counted: all (Hoffmann et al.'s count, "
        "embeddings and head included) or non_embedding (the decoder layers and norms)")
    warmup: float = Field(
        0.1, ge=0, lt=1, description="warmup steps as a fraction of each budget's steps")

    @field_validator("tokens", "chinchilla", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        """YAML 1.1 reads `1e7` as a string; take it as the number it looks like."""
        if not isinstance(value, list):
            return value
        return [_as_number(v) for v in value]

    @field_validator("tokens")
    @classmethod
    def _whole_tokens(cls, value: list[int] | None) -> list[int] | None:
        return _entries(value, "tokens", "token counts")

    @field_validator("chinchilla")
    @classmethod
    def _multiples(cls, value: list[float] | None) -> list[float] | None:
        return _entries(value, "chinchilla", "multiples, e.g. [1, 2, 4, 8]")

    @model_validator(mode="after")
    def _one_kind(self) -> BudgetConfig:
        if (self.tokens is None) == (self.chinchilla is None):
            raise UserError("budget: give tokens or chinchilla, not both and not neither "
                            "(allowed: {tokens: [T1, ...]} or {chinchilla: [M1, ...], params: "
                            "all|non_embedding})")
        if self.tokens is not None and "params" in self.model_fields_set:
            raise UserError("budget.params: counts parameters for chinchilla budgets only; "
                            "remove it with budget.tokens")
        return self

    @property
    def entries(self) -> list[Budget]:
        """One `Budget` per listed value, in the file's order."""
        if self.tokens is not None:
            return [Budget(tokens=t) for t in self.tokens]
        return [Budget(chinchilla=m, params=self.params) for m in self.chinchilla or []]


def _as_number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    return value


def _entries(value: list[Any] | None, key: str, allowed: str) -> list[Any] | None:
    if value is None:
        return None
    if not value:
        raise UserError(f"budget.{key}: an empty list (allowed: a list of {allowed})")
    for v in value:
        if value.count(v) > 1:
            raise UserError(f"budget.{key}: {v} is listed twice (allowed: {allowed}, each once)")
    return value


@dataclass(frozen=True)
class Budget:
    """One budget of a sweep, as written: a token count, or a Chinchilla multiple whose tokens
    depend on the trial's model (`tokens_for`)."""

    tokens: int | None = None
    chinchilla: float | None = None
    params: Counted = "all"

    @property
    def key(self) -> str:
        """The sweep file's key path of this entry, for error lines."""
        return "budget.tokens" if self.tokens is not None else "budget.chinchilla"

    def tokens_for(self, params: int) -> int:
        """The budget's tokens for a model of `params` counted parameters."""
        if self.tokens is not None:
            return self.tokens
        return round(self.chinchilla * TOKENS_PER_PARAM * params)

    def train_keys(self, params: int, tokens_per_step: int, warmup: float) -> dict[str, Any]:
        """A trial's train keys for this budget: its steps (whole steps within the budget), its
        warmup and its mark (`train.budget`); a budget below one step is refused in one line.
        `params`: the model's counted parameters (read by chinchilla budgets only)."""
        tokens = self.tokens_for(params)
        steps = tokens // tokens_per_step
        if steps < 1:
            asked = (f"{self.chinchilla:g} x {TOKENS_PER_PARAM} x {params:,} ({self.params} "
                     f"parameters) = {tokens:,} tokens" if self.chinchilla is not None
                     else f"{tokens:,} tokens")
            raise UserError(f"{self.key}: {asked} is less than one optimizer step of "
                            f"{tokens_per_step:,} tokens (train.total_batch_size x "
                            f"task.seq_len); allowed: at least {tokens_per_step:,} tokens")
        chinchilla = self.chinchilla is not None
        mark = BudgetMark(tokens=tokens, chinchilla=self.chinchilla,
                          params=self.params if chinchilla else None,
                          counted=params if chinchilla else None)
        return {"steps": steps, "warmup_steps": warmup_steps(steps, warmup),
                "budget": mark.model_dump()}


def warmup_steps(steps: int, fraction: float) -> int:
    """`fraction` of `steps`, rounded half up."""
    return int(fraction * steps + 0.5)


def check_budget_sweep(data: dict[str, Any]) -> None:
    """A sweep file with `budget:` as written: nothing else may set the steps or warmup its
    budgets decide (the sweep's train, a method's train, a search space), it pretrains, and its
    trials are planned as a grid (one study per method would mix the budgets)."""
    where = {"train": data.get("train"), "search.space": _get(data.get("search"), "space")}
    methods = data.get("methods")
    for label, entry in (methods.items() if isinstance(methods, dict) else []):
        where[f"methods.{label}.train"] = _get(entry, "train")
        where[f"methods.{label}.space"] = _get(entry, "space")
    for path, keys in where.items():
        prefix = "" if path.endswith("train") else "train."
        for key in SET_BY_BUDGET:
            if isinstance(keys, dict) and f"{prefix}{key}" in keys:
                raise UserError(_set_twice(f"{path}.{prefix}{key}", key))
    if _get(data.get("task"), "kind") == "glue":
        raise UserError("budget: counts pretraining tokens, and task.kind is glue (allowed with "
                        "glue: train.epochs or train.steps, without budget)")
    sampler = _get(data.get("search"), "sampler")
    if sampler not in (None, "grid"):
        raise UserError(f"budget with search.sampler {sampler}: an Optuna study per method would "
                        "mix the budgets' trials (allowed: sampler grid)")


def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, dict) else None


def _set_twice(path: str, key: str) -> str:
    if key == "epochs":
        return (f"{path}: a budget counts tokens, and epochs (GLUE) count passes over a "
                "training set (allowed: one of them; remove budget or train.epochs)")
    what = "steps (tokens / tokens per step)" if key == "steps" else "warmup (budget.warmup)"
    return (f"{path}: budget sets each trial's {what}; remove {path} (allowed with budget: "
            f"neither train.steps nor train.warmup_steps)")


class BudgetMark(Strict):
    """What a trial records of the budget it belongs to (`train.budget`), written by a sweep's
    `budget:`: the report groups trials by it. Its steps are `train.steps`."""

    tokens: int = Field(ge=1, description="the budget's tokens: asked, or the Chinchilla "
                        "multiple x 20 x the counted parameters")
    chinchilla: float | None = Field(None, gt=0, description="the Chinchilla multiple, if given")
    params: Counted | None = Field(None, description="chinchilla: which parameters were counted")
    counted: int | None = Field(None, ge=1, description="chinchilla: how many there were")

    def describe(self) -> str:
        """The dry run's cell: "2x Chinchilla (14,720,000 tokens)" or "10,000,000 tokens"."""
        if self.chinchilla is None:
            return f"{self.tokens:,} tokens"
        return f"{self.chinchilla:g}x Chinchilla ({self.tokens:,} tokens)"
