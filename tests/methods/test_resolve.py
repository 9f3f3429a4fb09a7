"""methods/resolve.py: a run's method checked against the registry once, with its defaults,
and the modifiers each method refuses, with its reason."""

from __future__ import annotations

import pytest
from conftest import micro_run

from harness.errors import UserError
from harness.methods import method_names
from harness.methods.resolve import MODIFIER_TRIALS, load_run, modifier_support


def test_the_method_gets_its_defaults_and_typed_settings():
    run = load_run({**micro_run(), "method": {"name": "galore", "rank": 8}})
    assert run.method["name"] == "galore" and run.method["rank"] == 8
    assert run.method["update_proj_gap"] == 200  # the default, written out
    assert run.method_settings.rank == 8 and run.method_params == {
        k: v for k, v in run.method.items() if k != "name"}


def test_a_resolved_run_has_the_same_identity_as_its_written_defaults():
    short = load_run({**micro_run(), "method": {"name": "full"}})
    spelled = load_run({**micro_run(), "method": {"name": "full", "betas": [0.9, 0.999],
                                                  "eps": 1e-8}})
    assert short.identity() == spelled.identity()
    assert load_run(short.model_dump()).identity() == short.identity()  # config.yaml round trip


def test_overrides_apply_before_validation():
    run = load_run(micro_run(), {"method.name": "lora", "method.rank": 4, "train.steps": 3})
    assert (run.method_name, run.method["rank"], run.train.steps) == ("lora", 4, 3)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ({"rank": 4}, r"^missing key 'method.name' \(a method name; see `harness methods`\)"),
        ({"name": "galroe"}, r"^method.name: unknown method 'galroe' \(did you mean 'galore'"),
        ({"name": "lora", "rnak": 4}, r"^unknown key 'method.rnak' \(did you mean 'rank'"),
        ({"name": "lora", "rank": "big"}, r"^method.rank: 'big' is invalid"),
    ],
)
def test_bad_method_specs_are_one_line(method, message):
    with pytest.raises(UserError, match=message):
        load_run({**micro_run(), "method": method})


def test_a_pretraining_run_needs_a_preset():
    with pytest.raises(UserError, match=r"^model: unknown model preset 'bert' "):
        load_run({**micro_run(), "model": "bert"})


def test_modifier_support_tries_each_modifier_on_the_defaults():
    assert set(method_names()) >= {"full", "adam8bit", "lora", "relora", "qlora", "lowrank",
                                   "galore", "qgalore"}
    full = modifier_support("full")
    assert list(full) == list(MODIFIER_TRIALS) and not any(full.values())
    relora = modifier_support("relora")
    assert relora["layerwise"].startswith("ReLoRA's warm start")
    assert relora["recompute"] is None and relora["16-mixed"] is None
    assert modifier_support("lora")["fsdp"] is None
    assert relora["fsdp"] is None  # merges on the shards (tests/train/test_fsdp.py)
    assert modifier_support("fira")["fsdp"] is None
    galore = modifier_support("galore")
    assert galore["optimizer_offload paged"].startswith("its low-rank moments")
    qgalore = modifier_support("qgalore")
    assert qgalore["16-mixed"].startswith("its INT8 updates run inside backward")
    with pytest.raises(UserError, match=r"^method relora: ReLoRA's warm start"):
        load_run({**micro_run(), "method": {"name": "relora"}, "memory": {"layerwise": True}})
