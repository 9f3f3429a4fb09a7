"""Search spaces as the sweep file writes them: grid lists and Optuna distributions."""

from __future__ import annotations

from typing import Any

from harness.errors import UserError


def check_space(space: Any, path: str) -> dict[str, list[Any]]:
    if not isinstance(space, dict) or not all(isinstance(v, list) and v for v in space.values()):
        raise UserError(
            f"{path}: expected a mapping of dotted keys to non-empty lists, got {space!r}"
        )
    return space


def check_distributions(space: Any, path: str) -> dict[str, dict[str, Any]]:
    if not isinstance(space, dict):
        raise UserError(
            f"{path}: expected a mapping of dotted keys to distributions, got {space!r}"
        )
    return {key: distribution(value, f"{path}.{key}") for key, value in space.items()}


def _number(value: Any) -> float | int | None:
    """YAML 1.1 reads `1e-4` as a string; accept it as the number it looks like."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def distribution(value: Any, path: str) -> dict[str, Any]:
    """A list is categorical; `{low, high}` is a float range, or an int range when all are ints."""
    if isinstance(value, list):
        if not value:
            raise UserError(f"{path}: an empty list (a categorical needs at least one choice)")
        return {"choices": value}
    allowed = "a list of choices, or {low, high} with optional log: true or step"
    if not isinstance(value, dict) or not {"low", "high"} <= value.keys():
        raise UserError(f"{path}: {value!r} is not a distribution (allowed: {allowed})")
    if value.keys() - {"low", "high", "log", "step"}:
        extra = sorted(value.keys() - {"low", "high", "log", "step"})[0]
        raise UserError(f"{path}: unknown key '{extra}' (allowed: low, high, log, step)")
    low, high, step = (_number(value.get(k)) for k in ("low", "high", "step"))
    log = value.get("log", False)
    if low is None or high is None or (step is None and value.get("step") is not None):
        raise UserError(f"{path}: low, high and step must be numbers, got {value!r}")
    if not isinstance(log, bool):
        raise UserError(f"{path}.log: {log!r} is not allowed (allowed: true, false)")
    if low >= high:
        raise UserError(f"{path}: low {low} must be below high {high}")
    if log and (low <= 0 or step is not None):
        raise UserError(f"{path}: log: true needs low > 0 and no step, got {value!r}")
    if step is not None and step <= 0:
        raise UserError(f"{path}.step: {step} must be positive")
    is_int = all(isinstance(v, int) for v in (low, high, step if step is not None else 1))
    return {"low": low, "high": high, "log": log, "step": step, "int": is_int}
