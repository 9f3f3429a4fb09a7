"""YAML in, typed configs out: reading files, `--set` overrides, and pydantic's report
turned into one line naming the key path, the bad value and what is allowed."""

from __future__ import annotations

import difflib
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Discriminator, RootModel, Tag, ValidationError

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
    loc, allowed, others = _walk(model, [str(p) for p in err["loc"]])
    path = (prefix + ".".join(loc)).rstrip(".")
    more = f" (and {count - 1} more problem{'s' * (count > 2)})" if count > 1 else ""
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else _elsewhere(loc[-1], others)
        return f"unknown key '{path}' ({hint}allowed: {', '.join(allowed)}){more}"
    if kind == "missing":
        return f"missing key '{path}'{more}"
    if kind == "union_tag_invalid":  # a tagged union's tag: `kind` names the member
        key = err["ctx"]["discriminator"].strip("'").removesuffix("()")
        value = value.get(key) if isinstance(value, dict) else value
        path, kind = f"{path}.{key}".lstrip("."), "literal_error"
        err = {**err, "ctx": {"expected": " or ".join(
            err["ctx"]["expected_tags"].rsplit(", ", 1))}}
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{path}: {value!r} is not allowed (allowed: {expected}){more}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return f"{path or 'config'}: {msg}{more}"
    return f"{path}: {value!r} is invalid ({msg}){more}"


def _walk(model: type[BaseModel], loc: list[str]) -> tuple[list[str], list[str], dict[str, Any]]:
    """`loc` without the tags pydantic adds where it checks a member of a tagged union; the
    field names beside its last key (for 'allowed:' and suggestions); and, where those are one
    union member's, the other members' field names by tag."""
    root = model.model_fields["root"] if issubclass(model, RootModel) else None
    node: tuple[Any, list[Any]] = (root.annotation, root.metadata) if root else (model, [])
    clean: list[str] = []
    allowed: list[str] = []
    others: dict[str, list[str]] = {}
    beside: dict[str, list[str]] = {}
    for part in loc:
        members = _members(*node)
        if members:  # `part` is the tag of the member the value was checked as
            others = {t: list(m.model_fields) for t, m in members.items() if m is not
                      members.get(part)}
            node = (members.get(part), [])
            continue
        allowed, beside, others = _fields(node[0]), others, {}
        clean.append(part)
        field = node[0].model_fields.get(part) if allowed else None
        node = (field.annotation, field.metadata) if field else (None, [])
    return clean, allowed, beside


def _fields(annotation: Any) -> list[str]:
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return list(annotation.model_fields) if is_model else []


def _members(annotation: Any, metadata: list[Any]) -> dict[str, type[BaseModel]]:
    """A tagged union's members by tag (`Annotated[Union[Annotated[M, Tag(t)], ...],
    Discriminator(...)]`); {} for any other annotation."""
    if not any(isinstance(m, Discriminator) for m in metadata) or get_origin(annotation) not in (
            Union, UnionType):
        return {}
    members = {}
    for arg in get_args(annotation):
        model, *extra = get_args(arg) or (arg,)
        members.update({m.tag: model for m in extra if isinstance(m, Tag)})
    return members


def _elsewhere(key: str, others: dict[str, list[str]]) -> str:
    """Where a key unknown here is another union member's: which member has it (or one close)."""
    near = {tag: difflib.get_close_matches(key, names, n=1) for tag, names in others.items()}
    found = {tag: close[0] for tag, close in near.items() if close}
    if not found:
        return ""
    name = next(iter(found.values()))
    tags = " and ".join(tag for tag, close in found.items() if close == name)
    return (f"'{name}' is a key of kind {tags}; " if name == key
            else f"did you mean '{name}', a key of kind {tags}? ")
