"""Search spaces as the sweep file writes them: grid lists and Optuna distributions."""

from __future__ import annotations

from typing import Any

from harness.errors import UserError


def check_space(space: Any, path: str) -> dict[str, list[Any]]:
    """A grid: each dotted key to the non-empty list of values it takes."""
    if not isinstance(space, dict):
        raise UserError(
            f"{path}: expected a mapping of dotted keys to non-empty lists, got {space!r}"
        )
    for key, values in space.items():
        _check_key(key, path)
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}.{key}: expected a non-empty list of values, got {values!r}")
    return space


def check_distributions(space: Any, path: str) -> dict[str, dict[str, Any]]:
    if not isinstance(space, dict):
        raise UserError(
            f"{path}: expected a mapping of dotted keys to distributions, got {space!r}"
        )
    for key in space:
        _check_key(key, path)
    return {key: distribution(value, f"{path}.{key}") for key, value in space.items()}


def _check_key(key: Any, path: str) -> None:
    """A space's key is set into each trial's config (`set_dotted`), so a dotted string."""
    if not isinstance(key, str) or not all(key.split(".")):
        raise UserError(f"{path}: {key!r} is not a dotted key of the run config (e.g. train.lr)")


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
