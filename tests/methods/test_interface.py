"""The method interface's shape: every registered method's byte arithmetic is a companion
beside its file, the training class holds none of it, and the lists that name methods come
from the registry (a method added is its file, its companion and its test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.bench import memory as bench_memory
from harness.methods import base, get_memory, get_method, method_names
from harness.methods.memory import Memory

METHODS_DIR = Path(base.__file__).parent
BYTE_HOOKS = ("estimate", "estimate_sharded", "update_bytes", "measure", "linears")


@pytest.mark.parametrize("name", method_names())
def test_every_method_has_its_companion_in_the_file_beside_it(name):
    method, memory = get_method(name), get_memory(name)
    module = method.__module__.rpartition(".")[2]
    assert memory.__module__ == f"{method.__module__}_memory"
    assert (METHODS_DIR / f"{module}_memory.py").is_file()
    assert issubclass(memory, Memory) and memory.name == name


@pytest.mark.parametrize("name", method_names())
def test_no_training_class_holds_byte_arithmetic(name):
    """Neither the base class nor any method (or a class it inherits from) defines the
    estimate, the update bytes, the count or what its linears become."""
    for cls in get_method(name).__mro__:
        assert not set(vars(cls)) & set(BYTE_HOOKS), cls


def test_module_surgery_is_not_in_the_interface_file():
    source = (METHODS_DIR / "base.py").read_text()
    assert "def replace_linears" not in source and "def target_linears" not in source
    assert "def tensor_bytes" not in source and "class MemoryEstimate" not in source


class _Toy(base.Method):
    summary = "a method registered only by this test"


class _ToyMemory(Memory):
    bench = {"rank": 3}  # noqa: RUF012 (a test's class)
    variants = {"toy_layerwise": {"method": "toy"}, "other": {"method": "full"}}  # noqa: RUF012


def test_a_method_without_its_companion_is_refused(monkeypatch):
    monkeypatch.setitem(base._REGISTRY, "toy", _Toy)
    with pytest.raises(TypeError, match=r"method toy .* has no Memory registered as 'toy'"):
        base.check_companions()
    monkeypatch.setitem(base._MEMORY, "toy", _ToyMemory)  # registered, but not beside it
    assert _ToyMemory.__module__ != f"{_Toy.__module__}_memory"
    with pytest.raises(TypeError, match="has no Memory registered as 'toy'"):
        base.check_companions()


def test_bench_memory_lists_every_registered_method_and_its_own_variants(monkeypatch):
    """A method registered later is benched at its companion's settings, with the variants
    that name it (not those naming another method)."""
    monkeypatch.setitem(base._REGISTRY, "toy", _Toy)
    monkeypatch.setitem(base._MEMORY, "toy", _ToyMemory)
    entries = bench_memory.entries()
    assert entries["toy"] == {"rank": 3} and entries["toy_layerwise"] == {"method": "toy"}
    assert "other" not in entries
    assert set(method_names()) <= set(entries)


def test_bench_memory_list_is_the_registry_with_its_variants():
    """Today's list: every registered method once, and the two layer-wise variants."""
    variants = {"galore_8bit_layerwise", "apollo_mini_int8_layerwise"}
    assert set(bench_memory.METHODS) == set(method_names()) | variants
    assert bench_memory.METHODS["galore_8bit_layerwise"] == {
        "method": "galore", "rank": 16, "optimizer": "adam8bit"}
    assert bench_memory.METHODS["lora"] == {"rank": 8} and bench_memory.METHODS["full"] == {}
