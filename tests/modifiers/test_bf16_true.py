"""train.precision bf16-true (harness/modifiers/precision.py, compensation.py): the model, its
gradients and activations in bfloat16; optimizer states in train.state_dtype; an update below
bfloat16's resolution lost by round-to-nearest and kept by stochastic rounding and Kahan
summation; exact resume with each compensation; refusals; the old precision names."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import micro_run, train_losses
from test_modifiers import METHODS

from harness.config import RunConfig
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.modifiers.compensation import KAHAN, AdamW, add_update, pure_adamw
from harness.modifiers.optimizer import unwrap
from harness.train import train
from harness.train.loop import Trainer
from harness.trials import Records

BF16 = torch.bfloat16
GALORE_STATES = {"state_dtype": "bfloat16"}  # GaLore's moments follow the weights, as upstream


def pure_run(method: str = "full", steps: int = 4, **train_keys: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, precision="bf16-true", **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    data["method"] = METHODS[method]
    return data


# -- the shared update function ------------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tiny_updates_lost_to_rounding_are_kept_by_sr_and_kahan(sign):
    """1e-4 a step on weights of magnitude 1 (bf16's spacing there: 2^-7): round to nearest
    never moves them; stochastic rounding gets there on average, Kahan in sum (weight plus its
    bfloat16 buffer)."""
    torch.manual_seed(0)
    update = torch.full((4096,), sign * 1e-4)
    weights = {mode: torch.full((4096,), sign, dtype=BF16) for mode in
               ("none", "stochastic_rounding", "kahan")}
    states: dict[str, dict[str, Any]] = {mode: {} for mode in weights}
    for _ in range(100):
        for mode, w in weights.items():
            add_update(w, update.clone(), mode, states[mode])  # it consumes the update
    target = sign * 1.01
    assert torch.equal(weights["none"], torch.full((4096,), sign, dtype=BF16))
    assert weights["stochastic_rounding"].float().mean().item() == pytest.approx(target, abs=2e-4)
    kahan, comp = weights["kahan"].float(), states["kahan"][KAHAN]
    assert comp.dtype == BF16 and (kahan - target).abs().max() <= 2**-8  # nearest bf16
    # in sum, up to the buffer's own bf16 rounding: within 5% of the 0.01 round-to-nearest lost
    assert (kahan + comp.float() - target).abs().max() < 5e-4
    assert states["none"] == states["stochastic_rounding"] == {}


def test_float32_weights_are_added_plainly():
    w = torch.ones(3)
    add_update(w, torch.full((3,), 1e-6), "kahan", state := {})
    assert torch.equal(w, torch.full((3,), 1 + 1e-6)) and state == {}


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["none", "stochastic_rounding", "kahan"])
def test_adamw_states_follow_state_dtype_and_survive_a_reload(state_dtype, mode):
    train = load_run(pure_run(state_dtype=state_dtype, update_compensation=mode)).train
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=BF16))
    opt = pure_adamw([{"params": [p], "weight_decay": 0.1}], train, (0.9, 0.999), 1e-8)
    p.grad = torch.randn_like(p)
    opt.step()
    dtypes = {k: v.dtype for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq")}
    assert set(dtypes.values()) == {getattr(torch, state_dtype)}
    assert isinstance(opt.state[p].get(KAHAN), torch.Tensor) == (mode == "kahan")
    again = pure_adamw([{"params": [p], "weight_decay": 0.1}], train, (0.9, 0.999), 1e-8)
    again.load_state_dict(opt.state_dict())
    assert {k: v.dtype for k, v in again.state[p].items() if k in dtypes} == dtypes
    if state_dtype == "float32" or mode == "stochastic_rounding":
        assert isinstance(opt, AdamW)
    else:
        assert type(opt).__module__.startswith("optimi")


# -- a bf16-true trial -----------------------------------------------------------------------
def test_weights_gradients_activations_and_states_are_bf16(tmp_path):
    run = load_run(pure_run(state_dtype="bfloat16", update_compensation="kahan"))
    trainer = Trainer(run, Records(tmp_path / "t", run), lambda step: False)
    seen: dict[str, set[torch.dtype]] = {"grads": set(), "acts": set()}
    for p in trainer.model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen["grads"].add(p.grad.dtype))
    for m in trainer.model.modules():
        m.register_forward_hook(lambda m, i, out: seen["acts"].update(
            o.dtype for o in (out if isinstance(out, tuple) else (out,))
            if isinstance(o, torch.Tensor) and o.is_floating_point()))
    assert {p.dtype for p in trainer.model.parameters()} == {BF16}
    assert {b.dtype for b in trainer.model.buffers() if b.is_floating_point()} <= {BF16}
    loss = trainer.train_step()
    assert math.isfinite(loss.item()) and seen["grads"] == {BF16} and seen["acts"] == {BF16}
    states = [v for s in trainer.optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert states and {s.dtype for s in states} == {BF16}


def test_the_model_is_cast_before_it_moves_to_the_device(tmp_path, monkeypatch):
    """On CUDA a float32 model moved first would fill the device with it (LLaMA-7B: 27 GB)
    before the cast; the move must see bfloat16 weights already (here the CPU stands in)."""
    from transformers import LlamaForCausalLM

    moved: list[torch.dtype] = []
    to = LlamaForCausalLM.to

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, torch.device) for a in (*args, *kwargs.values())):
            moved.append(next(self.parameters()).dtype)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "to", spy)
    run = load_run(pure_run())
    Trainer(run, Records(tmp_path / "t", run), lambda step: False).close()
    assert moved and set(moved) == {BF16}


# Refuse bf16-true, saying why (tests/method_matrix.py's REFUSED has their pairs).
REFUSES_BF16_TRUE = {"schedule_free": "its train/eval switch moves bfloat16 weights"}


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_under_bf16_true(tmp_path, method):
    if method in REFUSES_BF16_TRUE:
        with pytest.raises(UserError, match=f"^method {method}: {REFUSES_BF16_TRUE[method]}"):
            load_run(pure_run(method, steps=2))
        return
    summary = train(load_run(pure_run(method, steps=2)), tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert all(math.isfinite(v) for v in train_losses(tmp_path / "t").values())


@pytest.mark.parametrize("method", ["galore", "qgalore", "adam8bit"])
@pytest.mark.parametrize(("state_dtype", "mode"), [("float32", "stochastic_rounding"),
                                                   ("bfloat16", "kahan")])
def test_own_optimizers_honour_state_dtype_and_compensation(tmp_path, method, state_dtype, mode):
    """GaLore's optimizer (and Q-GaLore's, 8-bit Adam's under these keys, built on it): 32-bit
    moments in state_dtype, a Kahan buffer per trained bf16 weight, a trial that trains."""
    run = load_run(pure_run(method, steps=2, state_dtype=state_dtype, update_compensation=mode))
    trainer = Trainer(run, Records(tmp_path / "t", run), lambda step: False)
    for _ in range(2):
        assert math.isfinite(trainer.train_step().item())
    states = [s for o in unwrap(trainer.optimizer) for s in o.state.values()]
    int8 = getattr(trainer.optimizer, "layer_state", {})  # Q-GaLore's INT8 layers' moments
    assert bool(int8) == (method == "qgalore")
    states += [st["moments"] for st in int8.values()]
    moments = {v.dtype for s in states for k, v in s.items() if k.startswith("exp_avg")}
    assert moments == {getattr(torch, state_dtype)}
    kahan = [s[KAHAN] for s in states if KAHAN in s]
    assert bool(kahan) == (mode == "kahan") and {k.dtype for k in kahan} <= {BF16}


SR = {"update_compensation": "stochastic_rounding"}
KAHAN_BF16 = {"update_compensation": "kahan", "state_dtype": "bfloat16"}
RESUMED = [
    ("full", {"update_compensation": "none"}),
    ("full", SR),
    ("full", {"update_compensation": "kahan"}),
    ("full", KAHAN_BF16),  # torch-optimi
    ("galore", GALORE_STATES),
    ("galore", {"update_compensation": "kahan"}),
    ("galore", SR),
    ("qgalore", {"update_compensation": "kahan"}),
    ("adam8bit", KAHAN_BF16),
]
# The quick tier keeps bf16-true's default with full and Schedule-Free's refusal; GaLore,
# Q-GaLore and 8-bit Adam train in test_own_optimizers_honour_state_dtype_and_compensation, and
# four resumes stay (full AdamW with the generator, and with Kahan and bfloat16 states;
# GaLore's states; 8-bit Adam's); the other cases run in the integration tier (tests/tiers.py).
# Every method trains under bf16-true in the method x modifier matrix, which CI runs
# (tests/modifiers/test_modifiers.py: Kahan with float32 states, and round-to-nearest with
# bfloat16 states, 4 steps each, near float32's losses, refusals by name): the other methods'
# 2 finite steps here add nothing to it, so only `pytest --exhaustive` runs them.
BF16_DEFAULT_KEPT = ("full", *REFUSES_BF16_TRUE)
QUICK = {
    "test_every_method_trains_under_bf16_true": {(method,) for method in BF16_DEFAULT_KEPT},
    "test_resume_under_bf16_true_is_exact": [
        ("full", SR), ("full", KAHAN_BF16), ("galore", GALORE_STATES), ("adam8bit", KAHAN_BF16)],
}
EXHAUSTIVE = {"test_every_method_trains_under_bf16_true": {
    (method,) for method in METHODS if method not in BF16_DEFAULT_KEPT}}


@pytest.mark.parametrize(("method", "keys"), RESUMED)
def test_resume_under_bf16_true_is_exact(tmp_path, method, keys):
    """Stopped after step 2 and resumed: the same losses as a run never stopped (the Kahan
    buffers and float32 moments come back from the checkpoint, the generator too)."""
    data = pure_run(method, **keys)
    whole = train(load_run(data), tmp_path / "whole")
    part = [train(load_run(data), tmp_path / "part", should_stop=stop)
            for stop in (lambda step: step == 2, None)]
    assert [(r["status"], r["step"]) for r in part] == [("interrupted", 2), ("ok", 4)]
    assert whole["status"] == "ok"
    assert train_losses(tmp_path / "part") == train_losses(tmp_path / "whole")


@pytest.mark.parametrize(("mode", "rel"), [("kahan", 1e-5), ("stochastic_rounding", 1e-3)])
def test_layerwise_and_host_offload_inherit_the_compensation(tmp_path, mode, rel):
    """They wrap the method's optimizer: per parameter, or on bfloat16 host copies, the same
    updates as the plain step (no clipping: layer-wise clips each parameter on its own).
    Stochastic rounding draws in another order when layer-wise: equal up to that noise."""
    losses = []
    for memory in ({}, {"layerwise": True}, {"optimizer_offload": "host"}):
        data = {**pure_run(steps=3, grad_clip=None, update_compensation=mode), "memory": memory}
        out = tmp_path / str(len(losses))
        assert train(load_run(data), out)["status"] == "ok"
        losses.append(train_losses(out))
    assert losses[1] == pytest.approx(losses[0], rel=rel)
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)


# -- refusals and names ----------------------------------------------------------------------
@pytest.mark.parametrize(("method", "keys", "message"), [
    ("full", {"update_compensation": "kahan", "memory": {"optimizer_offload": "paged"}},
     r"^memory.optimizer_offload paged with train.precision bf16-true: bitsandbytes"),
])
def test_refused_at_load_time_with_the_reason(method, keys, message):
    keys = dict(keys)
    memory = keys.pop("memory", {})
    with pytest.raises(UserError, match=message):
        load_run({**pure_run(method, **keys), "memory": memory})


@pytest.mark.parametrize("key", ["state_dtype: bfloat16", "update_compensation: kahan"])
def test_pure_bf16_keys_are_refused_under_other_precisions(key):
    name, value = key.split(": ")
    with pytest.raises(UserError, match=rf"{name} applies to precision bf16-true only"):
        load_run({**micro_run(precision="bf16-mixed", **{name: value}), "method": {"name": "full"}})


# Trial ids the harness wrote before the precision modes (be503c6^: `fp32`, `bf16`, `fp16`, no
# state_dtype or update_compensation), measured by running that version's RunConfig.identity()
# on LEGACY_RUN: a finished trial of that version stays finished only if today's id is the same.
LEGACY_RUN: dict[str, Any] = {
    "name": "test", "model": "llama_micro",
    "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32, "shuffle_buffer": 32},
    "train": {"lr": 0.003, "steps": 6, "batch_size": 2, "total_batch_size": 4,
              "warmup_steps": 1, "log_every": 1},
    "eval": {"every": 3, "tokens": 256}, "method": {"name": "full"},
}  # fmt: skip
LEGACY_IDS = {"fp32": "06a073d7", "bf16": "0fb84120", "fp16": "eb41ea0b"}


def legacy_run(precision: str, name: str = "test", **train_keys: Any) -> RunConfig:
    return load_run({**LEGACY_RUN, "name": name,
                     "train": {**LEGACY_RUN["train"], "precision": precision, **train_keys}})


@pytest.mark.parametrize(("old", "new"), [("fp32", "32-true"), ("bf16", "bf16-mixed"),
                                          ("fp16", "16-mixed")])
def test_old_names_load_as_aliases_with_the_trial_ids_they_had(old, new):
    """Trial ids hash what earlier versions wrote: the old name, without the new keys."""
    legacy, today = legacy_run(old), legacy_run(new)
    assert legacy.train.precision == today.train.precision == new
    assert legacy.identity() == today.identity() == LEGACY_IDS[old]
    renamed = legacy_run(new, name="other", log_every=5, keep_checkpoints=3)
    assert renamed.identity() == LEGACY_IDS[old]  # bookkeeping is not in the id


def test_what_changes_results_changes_the_trial_id():
    """bf16-true is no old precision's alias, and the pure-bf16 keys away from their defaults,
    or another learning rate, are another trial."""
    ids = {legacy_run("bf16-true").identity(),
           legacy_run("bf16-true", state_dtype="bfloat16").identity(),
           legacy_run("bf16-true", update_compensation="kahan").identity(),
           legacy_run("fp32", lr=0.001).identity(), *LEGACY_IDS.values()}
    assert len(ids) == 7
