"""Bad input at scale: run and sweep configs generated from the pydantic schema, then mutated
(a wrong type, an unknown key, an out-of-range number, a missing key, an unknown method, a bad
memory string, a `--set`, a corrupted file). Each either loads, or fails with a UserError of one
line naming the key; any other exception is a traceback a user would see, and fails the test.

Loading only, no training: about 1,100 examples in all, derandomized so that CI sees the same
ones every run."""

from __future__ import annotations

import copy
import datetime
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from annotated_types import Ge, Gt, Le, Lt, MinLen
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from harness.cli import main
from harness.config import RunConfig, SearchConfig, SweepConfig
from harness.config.load import parse_overrides, read_yaml, set_dotted
from harness.cost.plan import parse_memory
from harness.errors import UserError, one_line
from harness.methods import get_method, method_names
from harness.methods.resolve import load_run
from harness.sweep.plan.expand import expand, load_sweep


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# Keys whose valid values the schema cannot say (a preset, a file, a module name), or
# whose other values most configs refuse.
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KINDS = ["attention", "mlp", "norm"]
KNOWN: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["llama_micro", "llama_tiny", "llama_60m"]),
    "tokenizer": st.just("sample"), "dataset": st.just("sample"), "glue_task": st.just("sample"),
    "validation": st.none(), "profile": st.none(), "storage": st.none(), "label": st.none(),
    "provenance": st.none(), "sbatch": st.just({}), "setup": st.just([]),
    "target_modules": st.lists(st.sampled_from(MODULES), min_size=1, max_size=3, unique=True),
    "recompute": st.sampled_from(["none", "full", ["attention"], ["mlp", "norm"]]),
    "offload": st.sampled_from(["none", ["mlp"]]),
    "mem": st.sampled_from([None, "64G", "500M", "0"]),
    "nodes": st.just(1), "tasks_per_node": st.just(1),  # DDP needs a launcher and a grid
    "name": st.text("abcxyz_-0123456789", min_size=1, max_size=8),
}  # fmt: skip


def bounds(metadata: list[Any]) -> dict[str, Any]:
    """annotated_types constraints as hypothesis bounds."""
    out: dict[str, Any] = {}
    for m in metadata:
        if isinstance(m, Ge | Gt):
            out["min_value"] = m.ge if isinstance(m, Ge) else m.gt
            out["exclude_min"] = isinstance(m, Gt)
        if isinstance(m, Le | Lt):
            out["max_value"] = m.le if isinstance(m, Le) else m.lt
            out["exclude_max"] = isinstance(m, Lt)
    return out


def value(annotation: Any, metadata: list[Any]) -> st.SearchStrategy[Any]:
    """A valid value of a field from its type and constraints, small enough to load fast."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is typing.Annotated:  # a tagged union's member (`launcher:`): its own keys
        return value(args[0], metadata)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([st.none() if a is type(None) else value(a, metadata) for a in args])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return section(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        b = bounds(metadata)
        low = b.get("min_value", 0)
        high = b.get("max_value", low + 16)
        if annotation is int:
            return st.integers(low + b.get("exclude_min", False), high)
        return st.floats(low, high, exclude_min=b.get("exclude_min", False),
                         exclude_max=b.get("exclude_max", False))
    if annotation is str:
        return st.text("abcdefgh_", min_size=1, max_size=6)
    if origin is tuple:
        return st.tuples(*(value(a, []) for a in args)).map(list)  # YAML has no tuples
    if origin is list:
        size = next((m.min_length for m in metadata if isinstance(m, MinLen)), 0)
        return st.lists(value(args[0], []), min_size=size, max_size=3)
    return st.just({})


def section(model: type[BaseModel], own: dict[str, Any] | None = None) -> st.SearchStrategy:
    """A mapping of some of the model's keys (every required one) to valid values; `own` gives
    the strategy of keys this module builds itself."""
    own = own or {}
    required, optional = {}, {}
    for key, field in model.model_fields.items():
        name = field.alias or key
        strategy = own[name] if name in own else KNOWN[name] if name in KNOWN else value(
            field.annotation, field.metadata)
        (required if field.is_required() else optional)[name] = strategy
    return st.fixed_dictionaries(required, optional=optional)


def method_spec(name: str) -> st.SearchStrategy[dict[str, Any]]:
    return section(get_method(name).Config)


NAMES = st.sampled_from(method_names())
RUN = NAMES.flatmap(lambda n: section(RunConfig, {"method": method_spec(n).map(
    lambda d: {"name": n, **d})}))


@st.composite
def method_entry(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A sweep's `methods:` entry: a registered name, or a label with `method:`."""
    name = draw(NAMES)
    entry = draw(method_spec(name))
    if draw(st.booleans()):
        entry["space"] = {"train.lr": draw(st.lists(st.floats(1e-4, 1e-2), min_size=1,
                                                    max_size=2))}
    if draw(st.booleans()):
        entry["memory"] = {"recompute": draw(KNOWN["recompute"])}
    labelled = draw(st.booleans())
    return (f"v_{name}", {"method": name, **entry}) if labelled else (name, entry)


GRID = st.fixed_dictionaries({"sampler": st.just("grid"), "space": st.fixed_dictionaries(
    {}, optional={"train.lr": st.lists(st.floats(1e-4, 1e-2), min_size=1, max_size=2),
                  "train.warmup_steps": st.lists(st.integers(0, 3), min_size=1, max_size=2)})})
OPTUNA = section(SearchConfig, {
    "sampler": st.sampled_from(["random", "tpe", "cmaes"]), "n_trials": st.integers(1, 4),
    "space": st.fixed_dictionaries({}, optional={
        "train.lr": st.just({"low": 1e-4, "high": 1e-2, "log": True}),
        "train.warmup_steps": st.just({"low": 0, "high": 3})}),
    "enqueue": st.just([]),
})  # fmt: skip
SWEEP = section(SweepConfig, {
    "methods": st.lists(method_entry(), min_size=1, max_size=3, unique_by=lambda e: e[0]).map(
        dict),
    "search": st.one_of(GRID, OPTUNA),
    "seeds": st.lists(st.integers(0, 3), min_size=1, max_size=2),
})  # fmt: skip

# What a careless edit puts where a value belongs.
BAD = [None, True, "abc", "", "1e-3", "none ", [], [1, "a"], {}, {"x": 1}, -1, 0, -0.5, 1e30,
       10**30, 2**63, math.nan, math.inf, -math.inf, datetime.date(2024, 1, 2), "\n", "é"]
BAD_KEYS = ["stpes", "lrr", "Name", "x.y", "", " ", "a\nb", "méthode", 1, True, None, 2.5,
            datetime.date(2024, 1, 2)]
BAD_MEMORY = ["attn", "Full", "", "none ", ["mlp", "mlp"], ["gpu"], [], "64X", "lots", "-1G",
              "1.5G", "64 G"]
BAD_METHODS = ["ful", "FULL", "", "lora ", "a\nb", 3, None, ["full"]]


def paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in the config, list items included."""
    items = (data.items() if isinstance(data, dict)
             else enumerate(data) if isinstance(data, list) else [])
    out = []
    for key, child in items:
        out.append((*prefix, key))
        out.extend(paths(child, (*prefix, key)))
    return out


def at(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


@dataclass
class Case:
    base: dict[str, Any]  # as generated
    data: dict[str, Any]  # mutated
    path: tuple  # the key path the mutation touched
    key: Any  # the key a message about it must name ("" when nothing was touched)


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> Case:
    """A generated config and a copy with one mutation."""
    original = draw(base)
    data = copy.deepcopy(original)
    everything = paths(data)
    kind = draw(st.sampled_from(["type", "range", "unknown", "missing", "method", "memory"]))
    if kind == "unknown":
        where = draw(st.sampled_from([()] + [p for p in everything if isinstance(at(data, p),
                                                                              dict)]))
        key = draw(st.sampled_from(BAD_KEYS))
        at(data, where)[key] = draw(st.sampled_from(BAD))
        return Case(original, data, (*where, key), key)
    if kind == "method":
        spots = [p for p in everything if p[-1] in ("name", "method") and len(p) > 1]
    elif kind == "memory":
        spots = [p for p in everything if p[-1] in ("recompute", "offload", "mem")]
    elif kind == "range":
        spots = [p for p in everything if isinstance(at(data, p), int | float)]
    else:
        spots = everything
    if not spots:
        return Case(original, data, (), "")
    path = draw(st.sampled_from(spots))
    parent = at(data, path[:-1])
    if kind == "missing" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        pool = {"method": BAD_METHODS, "memory": BAD_MEMORY}.get(kind, BAD)
        parent[path[-1]] = draw(st.sampled_from(pool))
    return Case(original, data, path, path[-1])


def outcome(load: typing.Callable[[], Any]) -> str | None:
    """None when it loads; else the UserError's message, checked to be one line."""
    try:
        load()
    except UserError as e:
        message = str(e)
        assert message and "\n" not in message and len(message) < 1000, message
        return message
    return None


def names(message: str | None, key: Any, path: tuple) -> bool:
    """The message names the mutated key as the file spells it (`true` for a key True, a
    newline escaped), or, for a removed one, the section it left."""
    spelled = [str(key), json.dumps(key, default=str).strip('"'), *map(str, path[-2:-1])]
    return message is None or key == "" or any(one_line(k) in message for k in spelled if k)


def write(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


def load_sweep_file(path: Path, overrides: dict[str, Any] | None = None) -> None:
    expand(load_sweep(path, overrides or {}))  # what `harness sweep --dry-run` and estimate do


def load_run_file(path: Path, overrides: dict[str, Any] | None = None) -> None:
    load_run(read_yaml(path), overrides)  # what `harness train` does


LOADERS = {"sweep": (SWEEP, load_sweep_file), "run": (RUN, load_run_file)}


@pytest.mark.parametrize(("kind", "examples"), [("sweep", 350), ("run", 350)])
def test_generated_configs_load_and_mutated_ones_fail_naming_the_key(kind, examples, tmp_path):
    base, load = LOADERS[kind]

    @fuzz(examples)
    @given(mutated(base))
    def check(case: Case) -> None:
        loaded = outcome(lambda: load(write(tmp_path, case.base))) is None
        message = outcome(lambda: load(write(tmp_path, case.data)))
        assert not loaded or names(message, case.key, case.path), (case.path, message)

    check()


@st.composite
def override(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> tuple[dict, str, str]:
    """A `--set KEY=VALUE` on a generated config: an existing key or a malformed one, and a
    value as the user types it."""
    data = draw(base)
    keys = [".".join(map(str, p)) for p in paths(data) if all(isinstance(k, str) for k in p)]
    key = draw(st.sampled_from([*keys, "train..lr", ".", "train.", "train.lr.x", "nope.x", ""]))
    text = draw(st.sampled_from(["abc", "[1, 2]", "{x: 1}", "null", "true", "-7", "1e30", ".nan",
                                 "2024-01-02", "[", "{", "", "'", "a: b: c"]))
    return data, f"{key}={text}", key


@pytest.mark.parametrize(("kind", "examples"), [("sweep", 100), ("run", 100)])
def test_overrides_fail_naming_the_key(kind, examples, tmp_path):
    base, load = LOADERS[kind]

    @fuzz(examples)
    @given(override(base))
    def check(case: tuple[dict, str, str]) -> None:
        data, item, key = case
        path = write(tmp_path, data)
        loaded = outcome(lambda: load(path)) is None
        message = outcome(lambda: load(path, parse_overrides([item])))
        parts = tuple(key.split("."))  # a message may name the first unknown part
        assert not loaded or any(names(message, k, ()) for k in parts), (item, message)

    check()


@fuzz(150)
@given(SWEEP, st.data())
def test_a_corrupted_file_is_one_line(tmp_path, sweep, data):
    """A sweep file cut short, or with a stray character or byte, as an editor leaves it."""
    text = yaml.safe_dump(sweep, sort_keys=False).encode()
    cut = data.draw(st.integers(0, len(text)))
    junk = data.draw(st.sampled_from([b"", b":", b"\t", b"[", b"{", b"'", b"&a", b"*a", b"!!python",
                                      b"\xff", b"\x00", b"- ", b"? ", b"%"]))
    tail = data.draw(st.sampled_from([b"", text[cut:]]))
    path = tmp_path / "sweep.yaml"
    path.write_bytes(text[:cut] + junk + tail)
    outcome(lambda: load_sweep_file(path))


@fuzz(60)
@given(st.one_of(st.text(max_size=12), st.from_regex(r"\s*[0-9.]{1,400}\s*[GMKTgmkti]*B?\s*",
                                                      fullmatch=True)))
@example("1" + "0" * 400 + "GB")  # an infinite float: OverflowError
@example("0.1B")  # no whole byte: a budget of 0
@example("24\nGB")  # a newline in the message
def test_memory_sizes_parse_or_fail_in_one_line(text):
    """`harness plan --memory`: a size of at least one byte, or one line naming the flag."""
    try:
        size = parse_memory(text)
    except UserError as e:
        assert str(e).startswith("--memory: ") and "\n" not in str(e), str(e)
    else:
        assert isinstance(size, int) and size >= 1


@fuzz(40)
@given(mutated(SWEEP))
def test_the_command_line_prints_one_line_and_exits_2(tmp_path_factory, capfd, case):
    """`harness estimate` on mutated sweeps: exit 0, or exit 2 with one line on stderr."""
    path = write(tmp_path_factory.mktemp("cli"), case.data)
    code = main(["estimate", str(path)])
    out, err = capfd.readouterr()
    assert code in (0, 2), err
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: ") and not out, err
    else:
        assert "trial" in out and "Traceback" not in err


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of a config, nested sections' keys included."""
    keys = []
    for key, field in model.model_fields.items():
        name = prefix + (field.alias or key)
        keys.append(name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += schema_keys(field.annotation, name + ".")
    return keys


SWEEP_ONLY = [k for k in schema_keys(SweepConfig) if k not in schema_keys(RunConfig)]


@pytest.mark.parametrize(("kind", "keys"), [("run", schema_keys(RunConfig)),
                                            ("sweep", SWEEP_ONLY)])
def test_every_key_takes_every_bad_value_in_one_line(kind, keys, tmp_path):
    """Exhaustive where the random cases are sparse: each key of the schema, set on a config
    that loads, to each bad value (a list where a name belongs used to crash the precision
    alias lookup)."""
    base = {"name": "s", "model": "llama_micro", "methods": {"full": {}}} if kind == "sweep" else {
        "model": "llama_micro"}
    load = LOADERS[kind][1]
    for key in keys:
        for bad in BAD:
            data = copy.deepcopy(base)
            set_dotted(data, key, bad)
            message = outcome(lambda: load(write(tmp_path, data)))  # noqa: B023 (called here)
            assert names(message, key.rsplit(".", 1)[-1], tuple(key.split("."))), (key, message)
