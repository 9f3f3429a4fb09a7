"""The method interface's shape: every registered method's byte arithmetic is a companion
beside its file, the training class holds none of it, and the lists that name methods come
from the registry (a method added is its file, its companion and its test)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_model, micro_run

from harness.bench import memory as bench_memory
from harness.methods import base, build_method, get_memory, get_method, method_names, optimizer_for
from harness.methods.memory import Memory
from harness.methods.resolve import load_run
from harness.modifiers.layerwise import LayerwiseOptimizer
from harness.modifiers.offload import HostOffloadOptimizer

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


def test_methods_reach_fsdp_only_through_its_one_helper():
    """What FSDP needs of an optimizer (its rows, gathers, sums, turns, saved states) is asked
    of harness/distributed/rows.py's `Rows`: no method file imports fsdp's functions or the
    process group's collectives itself (int8_optim's DDP average of INT8 gradients aside)."""
    allowed = {"harness.distributed.rows.Rows"}
    offenders = {}
    for path in sorted(METHODS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {f"{node.module}.{a.name}" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module for a in node.names}
        bad = {name for name in imported - allowed
               if name == "harness.distributed" or name.startswith("harness.distributed.")}
        if path.name == "int8_optim.py":
            bad -= {"harness.distributed"}
        if bad:
            offenders[path.name] = sorted(bad)
    assert offenders == {}


TRAINING_HOOKS = {"check", "prepare", "groups", "optimizer", "on_step", "export"}


def test_the_training_interface_is_six_hooks():
    hooks = {name for name, value in vars(base.Method).items()
             if callable(value) and not isinstance(value, type) and not name.startswith("_")}
    assert hooks == TRAINING_HOOKS


@pytest.mark.parametrize("name", method_names())
def test_no_method_overrides_anything_but_the_hooks(name):
    """What a method class adds of its own is private (`_find`) or not called by the harness."""
    for cls in get_method(name).__mro__[:-2]:  # the method's classes, not Method or object
        public = {n for n, v in vars(cls).items()
                  if callable(v) and not isinstance(v, type) and not n.startswith("_")}
        assert public <= TRAINING_HOOKS, (cls, public - TRAINING_HOOKS)


class _Sgd(base.Method):
    """An optimizer over param groups, as most new methods are: its `optimizer`, nothing else."""

    summary = "SGD, registered only by this test"

    def check(self, run):
        return base.Terms(fsdp=None)

    def optimizer(self, groups, run):
        return torch.optim.SGD(groups, lr=run.train.lr)


@pytest.mark.parametrize("memory", [{}, {"layerwise": True}, {"optimizer_offload": "host"}])
def test_a_new_optimizer_gets_the_memory_modifiers_from_the_trainer(monkeypatch, memory):
    """The harness, not the method, splits its optimizer per parameter or moves it to the
    host; either way a step is torch's SGD's over the whole model (no clipping: the layer-wise
    wrapper clips each gradient apart)."""
    monkeypatch.setitem(base._REGISTRY, "sgd", _Sgd)
    monkeypatch.setitem(base._MEMORY, "sgd", Memory)
    run = load_run({**micro_run(grad_clip=None), "method": {"name": "sgd"}, "memory": memory})
    model, reference = micro_model(0), micro_model(0)
    optimizer = optimizer_for(build_method(run), model, run)
    plain = torch.optim.SGD(reference.parameters(), lr=run.train.lr)
    ids = torch.randint(0, SAMPLE_VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    for net, opt in ((model, optimizer), (reference, plain)):
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    wrapper = {"layerwise": LayerwiseOptimizer, "optimizer_offload": HostOffloadOptimizer}
    assert isinstance(optimizer, wrapper.get(next(iter(memory), ""), torch.optim.SGD))
    moved = [not torch.equal(p, q) for p, q in zip(reference.parameters(),
                                                    micro_model(0).parameters(), strict=True)]
    assert all(moved)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())
