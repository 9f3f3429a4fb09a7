"""Memory modifiers with every method (tests/method_matrix.py): recompute and offload change no
numbers, layer-wise and host optimizer offload equal the plain step, fp16 scales the loss,
bf16-true stays close, each estimate equals the bytes counted; bad combinations are refused."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import SAMPLE_VOCAB, assert_estimate_matches, micro_model, micro_run, train_losses
from method_matrix import (
    ALL_PAIRS,
    CASES,
    EXACT,
    EXCLUDED,
    METHODS,
    MODEL_METHODS,
    MODIFIERS,
    PRECISIONS,
    REFUSED,
    REPRESENTATIVE,
    SETTINGS,
    baseline,
    exhaustive_cases,
    quick_cases,
    run_config,
)

from harness.errors import UserError
from harness.methods import build_memory
from harness.methods.base import method_names
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import train
from harness.train.loop import Trainer
from harness.trials import Records, read_jsonl

VOCAB = SAMPLE_VOCAB
QUICK = {"test_every_method_with_every_modifier": quick_cases()}  # the rest: integration tier
EXHAUSTIVE = {"test_every_method_with_every_modifier": exhaustive_cases()}  # method_matrix.py
# A precision's losses against float32 from the same init and data: the largest relative gap of
# a step's loss over the matrix's methods, seeds 0..2 (the test runs seed 0). 16-mixed: 1.7e-4
# (relora, seed 2; 3.2e-5 at seed 0), so 5e-4. bf16-true: 4.3e-4 with Kahan (relora, seed 2;
# 2.0e-4 at seed 0), 3.6e-4 with bf16 states (full, seed 0), so 1e-3. Four steps move the loss
# 0.25% (qlora) to 3.9% (adam_mini) at seed 0, and a run that never updated is 3.2e-3 (qlora)
# to 4.2e-2 away: it fails.
PRECISION_REL = {"16-mixed": 5e-4, "bf16_true_kahan": 1e-3, "bf16_true_bf16_states": 1e-3}
# CAME's RMS-normalized steps (ε1 1e-30: a gradient's rounding noise near 0 takes full-size
# steps) drift further by step 4 (seed 0): 1.9e-3 with Kahan, 1.6e-3 with bf16 states (bf16-
# mixed, not in the matrix: 2.8e-3), so 5e-3; the loss moves 3.6%.
METHOD_REL = {"came": 5e-3}


def refusal(method: str, modifier: str) -> str | None:
    try:
        load_run(run_config(method, modifier))
    except UserError as e:
        return str(e)
    return None


def test_the_matrix_names_only_registered_methods_and_modifiers():
    """Every registered method is in the matrix or EXCLUDED with its reason; what the matrix
    says of a method or a pair names one that exists."""
    registered = set(method_names())
    assert set(METHODS) == registered - set(EXCLUDED) and set(EXCLUDED) <= registered
    assert set(SETTINGS) <= set(METHODS)
    assert set(REFUSED) <= set(CASES)
    quick = QUICK["test_every_method_with_every_modifier"]
    assert {x for _, x in quick} == set(MODIFIERS) and {m for m, _ in quick} == set(METHODS)
    assert not quick & REFUSED
    assert set(EXACT) | set(PRECISIONS) <= set(MODIFIERS)
    assert REPRESENTATIVE in MODEL_METHODS <= set(METHODS)
    # only the model-side modifiers leave methods out, and only those that keep the model
    left_out = set(ALL_PAIRS) - set(CASES)
    assert {x for _, x in left_out} <= set(EXACT) and not {m for m, _ in left_out} & MODEL_METHODS
    assert {m for m, x in CASES if x in EXACT} == MODEL_METHODS


def test_methods_that_change_the_model_are_read_from_their_class():
    """A `prepare` of its own (LoRA, low-rank, Q-GaLore, APOLLO's INT8 option) puts a method
    in MODEL_METHODS; the optimizer-only ones (AdamW, 8-bit Adam, GaLore, Muon) stay out."""
    assert {"lora", "qlora", "relora", "lowrank", "qgalore", "apollo"} <= MODEL_METHODS
    assert not {"adam8bit", "adam_mini", "galore", "fira", "muon"} & MODEL_METHODS


@pytest.mark.parametrize("modifier", EXACT)
def test_model_side_modifiers_keep_the_parameters_and_gradients(modifier):
    """What lets CASES train them with one optimizer-only method: a model-side modifier keeps
    the model's modules, parameters (the same tensors, under the same names) and gradients."""
    from harness.config import MemoryConfig
    from harness.modifiers.recompute import apply

    def grads(model: torch.nn.Module) -> list[torch.Tensor]:
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        return [p.grad for p in model.parameters()]

    plain, model = (micro_model(0, "llama_micro", vocab=512, seq_len=16) for _ in range(2))
    modules, params = [n for n, _ in model.named_modules()], list(model.named_parameters())
    apply(model, MemoryConfig(**MODIFIERS[modifier]["memory"]), torch.device("cpu"))
    assert [n for n, _ in model.named_modules()] == modules
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in params]
    assert all(p is q for (_, p), (_, q) in zip(after, params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(model), strict=True))


@pytest.mark.parametrize("method", list(METHODS))
def test_every_methods_groups_hold_its_trained_parameters(tmp_path, method):
    """What GradScaler unscales before a 16-mixed step is the optimizer's `param_groups`: they
    hold every parameter the method trains, each once (a parameter left out would step on
    gradients still scaled by 2^16)."""
    run = load_run(run_config(method))
    trainer = Trainer(run, Records(tmp_path / "t", run), lambda step: False)
    try:
        grouped = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        assert len({id(p) for p in grouped}) == len(grouped)
        assert {id(p) for p in grouped} >= {id(p) for p in trained}
    finally:
        trainer.close()


def test_every_pair_the_matrix_does_not_train_loads_as_listed():
    """The pairs CASES leaves out are accepted at load time (or refused as REFUSED says), so
    leaving them out hides no refusal."""
    for method, modifier in sorted(set(ALL_PAIRS) - set(CASES)):
        reason = refusal(method, modifier)
        assert (reason is not None) == ((method, modifier) in REFUSED), (method, modifier, reason)


@pytest.mark.parametrize(("method", "modifier"), CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_every_method_with_every_modifier(tmp_path, tmp_path_factory, method, modifier):
    reason = refusal(method, modifier)
    if reason is not None:  # refused at load time, with the method's reason
        assert (method, modifier) in REFUSED, reason
        assert reason.startswith(f"method {method}: ") and len(reason) > 60
        return
    assert (method, modifier) not in REFUSED
    run = load_run(run_config(method, modifier))
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    losses, plain = train_losses(tmp_path / "t"), baseline(method, tmp_path_factory)
    assert losses.keys() == plain.keys() == {1, 2, 3, 4}
    if modifier in EXACT:
        assert losses == plain  # exactly: recompute and offload change no numbers
    elif modifier in PRECISIONS:  # fp16 autocast or bf16 weights: close to float32, not equal
        assert all(math.isfinite(v) for v in losses.values())
        rel = max(PRECISION_REL[modifier], METHOD_REL.get(method, 0))
        assert [losses[s] for s in plain] == pytest.approx(list(plain.values()), rel=rel)
        assert plain[1] - plain[4] > rel * plain[1]  # the loss moved by more than that
    else:  # per-parameter optimizers, or the same update on host copies
        assert [losses[s] for s in plain] == pytest.approx(list(plain.values()), rel=1e-5)
    if modifier == "16-mixed":
        lines = [r for r in read_jsonl(tmp_path / "t" / "metrics.jsonl") if r["kind"] == "train"]
        assert all(r["loss_scale"] > 0 and "skipped_steps" in r for r in lines)
        assert summary["skipped_steps"] >= 0 and summary["loss_scale"] > 0
    if modifier == "offload_mlp":
        assert summary["offloaded_bytes_per_step"] > 0
    estimate = build_memory(run).estimate(param_shapes(run.model, VOCAB), run)
    assert_estimate_matches(estimate, summary)


def test_layerwise_holds_one_gradient_at_a_time(tmp_path):
    data = {**run_config("full", "layerwise"), "train": {**run_config("full")["train"],
                                                         "total_batch_size": 2}}
    summary = train(load_run(data), tmp_path / "t")
    sizes = [p.numel() for p in param_shapes("llama_micro", VOCAB).values()]
    assert summary["grad_bytes"] == 4 * max(sizes) < 4 * sum(sizes) / 2


def test_fp16_overflow_skips_the_step_and_backs_off(tmp_path):
    """A scale of 2^40 overflows fp16 at once: those steps are skipped (logged as events, read
    without a per-step sync) and the scale backs off by 2^-12 each time, until updates run."""
    data = run_config("full", "16-mixed")
    data["train"].update(steps=6, loss_scale={"init": 2.0**40, "backoff_factor": 2.0**-12,
                                              "growth_interval": 100})
    summary = train(load_run(data), tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    rows = read_jsonl(tmp_path / "t" / "metrics.jsonl")
    skipped = [r["step"] for r in rows if r["kind"] == "event" and r.get("skipped") == "overflow"]
    assert skipped == list(range(1, summary["skipped_steps"] + 1)) and skipped  # the first ones
    assert summary["loss_scale"] == 2.0 ** (40 - 12 * len(skipped))  # one backoff each
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows[-1]["skipped_steps"] == len(skipped) < 6
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # the unskipped steps trained


@pytest.mark.parametrize("modifier", ["16-mixed", "optimizer_offload"])
def test_resume_keeps_loss_scale_and_host_states(tmp_path, modifier):
    """Stopped after step 2 and resumed: the same losses as a run never stopped."""
    data = run_config("galore" if modifier == "optimizer_offload" else "full", modifier)
    data["train"]["loss_scale"] = {"init": 2.0**20, "growth_interval": 1}  # changes each step
    whole = train(load_run(data), tmp_path / "whole")
    stopped = train(load_run(data), tmp_path / "part", should_stop=lambda step: step == 2)
    assert stopped["status"] == "interrupted" and stopped["step"] == 2
    resumed = train(load_run(data), tmp_path / "part")
    assert resumed["status"] == whole["status"] == "ok"
    assert train_losses(tmp_path / "part") == train_losses(tmp_path / "whole")
    assert resumed.get("loss_scale") == whole.get("loss_scale")


def test_paged_optimizer_states_train_like_the_plain_ones(tmp_path, tmp_path_factory):
    """bitsandbytes pages its states on CUDA; on CPU it falls back to the same update."""
    data = run_config("adam8bit")
    data["memory"] = {"optimizer_offload": "paged"}
    assert train(load_run(data), tmp_path / "t")["status"] == "ok"
    assert train_losses(tmp_path / "t") == baseline("adam8bit", tmp_path_factory)


def test_offload_moves_all_but_the_last_layer_and_prefetches_one_layer(tmp_path):
    """On llama_tiny (4 layers): layers 0-2 offload their MLP's saved tensors, parameters and
    tensors under the threshold stay, and backward holds at most two layers' fetched tensors
    (the one computing and the next) at any time; the gradients equal the plain ones."""
    from harness.config import MemoryConfig
    from harness.modifiers.recompute import apply
    from harness.modifiers.recompute import decoder_layers as layers_of

    def grads(memory: MemoryConfig) -> tuple[list[torch.Tensor], Any]:
        model = micro_model(0, "llama_tiny", vocab=512, seq_len=16)
        offloader = apply(model, memory, torch.device("cpu"))
        ids = torch.randint(0, 512, (2, 16))
        if offloader is not None:  # count the layers whose fetched tensors wait to be used
            waiting: dict[int, int] = {}
            fetch_one, unpack = offloader._fetch_one, offloader.unpack

            def fetched(saved: Any) -> None:
                fetch_one(saved)
                waiting[saved.layer] = waiting.get(saved.layer, 0) + 1
                offloader.most = max(offloader.most, sum(n > 0 for n in waiting.values()))

            def used(saved: Any) -> torch.Tensor:
                layer = getattr(saved, "layer", None)
                tensor = unpack(saved)
                if layer is not None:
                    waiting[layer] -= 1
                return tensor

            offloader.most = 0
            offloader._fetch_one, offloader.unpack = fetched, used
            with torch.no_grad():
                model(input_ids=ids)
            assert offloader.take_bytes() == 0  # eval saves nothing
            loss = model(input_ids=ids).logits.float().pow(2).mean()
            assert sorted(offloader.pending) == [0, 1, 2]
            assert offloader.take_bytes() > 0
            loss.backward()
            assert not offloader.pending and not any(waiting.values())
        else:
            model(input_ids=ids).logits.float().pow(2).mean().backward()
        assert len(layers_of(model)) == 4
        return [p.grad for p in model.parameters()], offloader

    plain, _ = grads(MemoryConfig())
    moved, offloader = grads(MemoryConfig(offload=["mlp", "norm"], offload_min_bytes=4096))
    assert all(torch.equal(a, b) for a, b in zip(plain, moved, strict=True))
    assert offloader.most == 2  # the layer computing and the one prefetched


@pytest.mark.parametrize(
    ("memory", "train_keys", "message"),
    [
        ({"recompute": ["mlp"], "offload": ["mlp", "norm"]}, {},
         "memory: mlp is both recomputed and offloaded"),
        ({"recompute": "full", "offload": ["mlp"]}, {}, "memory: recompute: full keeps no"),
        ({"recompute": ["mlp", "ffn"]}, {}, "memory.recompute: 'ffn' is not a module kind"),
        ({"recompute": "some"}, {}, "memory.recompute: 'some' is not allowed (allowed: none, full"),
        ({"offload": "full"}, {}, "memory.offload: 'full' is not allowed (allowed: none, or a"),
        ({"layerwise": True}, {"precision": "fp16"}, "config: memory.layerwise with train.pre"),
        ({"optimizer_offload": "cpu"}, {}, "memory.optimizer_offload: 'cpu' is not allowed"),
        ({}, {"loss_scale": {"backoff_factor": 2}}, "train.loss_scale.backoff_factor: 2"),
    ],
)
def test_impossible_combinations_are_refused_with_the_reason(memory, train_keys, message):
    data = micro_run(**train_keys)
    data["memory"] = memory
    with pytest.raises(UserError) as e:
        load_run(data)
    assert str(e.value).startswith(message), str(e.value)


def test_galore_refuses_paged_states():
    data = {**run_config("galore"), "memory": {"optimizer_offload": "paged"}}
    with pytest.raises(UserError, match="method galore: its low-rank moments"):
        load_run(data)


def saved_bytes(memory: dict[str, Any]) -> int:
    """Bytes autograd keeps for backward after one forward of llama_tiny with `memory`."""
    from harness.config import MemoryConfig
    from harness.modifiers.recompute import apply

    model = micro_model(None, "llama_tiny", vocab=512, seq_len=64)
    apply(model, MemoryConfig(**memory), torch.device("cpu"))
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 512, (2, 64))).logits.sum().backward()
    return total


def test_recompute_keeps_fewer_activations():
    plain = saved_bytes({})
    attention, mlp = saved_bytes({"recompute": ["attention"]}), saved_bytes({"recompute": ["mlp"]})
    full = saved_bytes({"recompute": "full"})
    assert full < min(attention, mlp) and max(attention, mlp) < plain
    print(f"saved for backward: plain {plain:,} B, attention {attention:,}, mlp {mlp:,}, "
          f"full {full:,}")


def test_a_sweep_varies_modifiers_and_a_method_sets_its_own(tmp_path):
    from conftest import write_yaml

    from harness.sweep.plan.expand import expand, load_sweep

    base = micro_run()
    sweep = {
        "name": "mods", "model": base["model"], "task": base["task"], "train": base["train"],
        "memory": {"offload": ["mlp"]},
        "methods": {"full": {}, "galore_lw": {"method": "galore", "rank": 8,
                                              "memory": {"layerwise": True}}},
        "search": {"space": {"memory.recompute": ["none", ["attention"]]}},
    }
    trials = expand(load_sweep(write_yaml(tmp_path / "s.yaml", sweep), {}))
    got = {(t.label, str(t.run.memory.recompute), t.run.memory.layerwise) for t in trials}
    assert got == {("full", "none", False), ("full", "['attention']", False),
                   ("galore_lw", "none", True), ("galore_lw", "['attention']", True)}
    assert all(t.run.memory.offloaded == ["mlp"] for t in trials)
    assert len({t.id for t in trials}) == 4
    sweep["methods"]["relora"] = {"rank": 4, "memory": {"layerwise": True}}
    with pytest.raises(UserError, match=r"^methods\.relora with .*: method relora: ReLoRA's"):
        expand(load_sweep(write_yaml(tmp_path / "s.yaml", sweep), {}))


def test_methods_command_lists_modifiers(capsys):
    from harness.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "  modifiers: recompute, offload, layerwise, optimizer_offload host, " \
           "optimizer_offload paged, 16-mixed, bf16-true, bf16-true kahan" in out
    assert "  refuses layerwise: ReLoRA's warm start" in out
    assert "  refuses 16-mixed: its INT8 updates run inside backward" in out
