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
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                        f"{e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        # A reader error (a NUL byte) has no `problem`, and its text runs over two lines.
        why = getattr(e, "problem", None) or getattr(e, "reason", None) or e
        raise UserError(f"{path}{where}: not valid YAML ({why})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys at the top level")
    _check_keys(data, path, "")
    return data


def _check_keys(node: Any, path: Path, where: str) -> None:
    """Every key a name: YAML reads `2024-01-01:`, `1:`, `true:` or `null:` as a date, number,
    bool or None, which no config key is (and which JSON, for the run's hash, cannot hold)."""
    if isinstance(node, list):
        for i, child in enumerate(node):
            _check_keys(child, path, f"{where}.{i}")
    elif isinstance(node, dict):
        for key, child in node.items():
            if not isinstance(key, str):
                raise UserError(f"{path}: key {key} in {where or 'the top level'} is not a name "
                                f"(YAML reads it as {type(key).__name__}); keys are names such "
                                "as train or lr")
            _check_keys(child, path, f"{where}.{key}" if where else key)


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    if not all(parts):
        raise UserError(f"{key}: a dotted key with an empty part (expected e.g. train.lr)")
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
