"""YAML in, typed configs out: reading files, `--set` overrides, and pydantic's report
turned into one line naming the key path, the bad value and what is allowed."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from harness.errors import UserError


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys at the top level")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"{key}: '{part}' is not a mapping, cannot set a key inside it")
        node = child
    node[parts[-1]] = value


def parse_overrides(sets: list[str]) -> dict[str, Any]:
    """`--set a.b=1` pairs; values are YAML, so 1e-3, true and [1, 2] mean what they look like."""
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KEY=VALUE (e.g. train.steps=20), got '{item}'")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise UserError(f"--set {key}: value '{raw}' is not valid YAML") from None
    return out


def validate(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """Validate and turn pydantic's report into one line naming the key path and what is allowed."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UserError(_explain(model, e.errors()[0], prefix, len(e.errors()))) from None


def _explain(model: type[BaseModel], err: dict[str, Any], prefix: str, count: int) -> str:
    loc = [str(p) for p in err["loc"]]
    path = (prefix + ".".join(loc)).rstrip(".")
    more = f" (and {count - 1} more problem{'s' * (count > 2)})" if count > 1 else ""
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"unknown key '{path}' ({hint}allowed: {', '.join(allowed)}){more}"
    if kind == "missing":
        return f"missing key '{path}'{more}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{path}: {value!r} is not allowed (allowed: {expected}){more}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return f"{path or 'config'}: {msg}{more}"
    return f"{path}: {value!r} is invalid ({msg}){more}"


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """Field names of the nested model at `loc`, for 'allowed:' lists and suggestions."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if hasattr(current, "model_fields") else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return []
        current = field.annotation
    return list(current.model_fields)
