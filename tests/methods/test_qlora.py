"""QLoRA: NF4 + double-quantized frozen linears (bitsandbytes) under peft adapters."""

from __future__ import annotations

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch
from conftest import assert_estimate_matches, micro_model
from test_lora import (
    VOCAB,
    adapter_count,
    estimate_and_measure,
    fast_run,
    learns,
    non_target_count,
    one_thread,  # noqa: F401  (autouse: these tests run on one thread too)
    resumes_exactly,
)

from harness.methods import build_memory, build_method, optimizer_for
from harness.methods.lora import TARGETS, adapter_params, lora_layers
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import train
from harness.train.pretrain import loss_sum


def prepared(seed: int = 0, **params):
    """The micro model (and a float copy of its target weights) under QLoRA."""
    run = load_run(fast_run({"name": "qlora", **params}))
    method = build_method(run)
    base = micro_model(seed)
    floats = {n: p.detach().clone() for n, p in base.named_parameters() if "proj" in n}
    model = method.prepare(base, run)
    return method, model, floats


def nf4_weights(model) -> dict[str, bnb.nn.Params4bit]:
    """Each target's packed weight, by the base model's parameter name."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer", ".weight"): module.weight
        for name, module in model.named_modules()
        if isinstance(module, bnb.nn.Linear4bit)
    }


def reference_dequantize(weight: bnb.nn.Params4bit) -> torch.Tensor:
    """Independent of bnb's 4-bit kernels: NF4 code · absmax (itself 8-bit + offset), blockwise."""
    qs = weight.quant_state
    absmax = bnbf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    packed = weight.data.view(-1)
    codes = torch.stack([packed >> 4, packed & 0xF], 1).view(-1)[: qs.shape.numel()]
    values = qs.code[codes.long()]
    return (values * absmax[torch.arange(values.numel()) // qs.blocksize]).view(qs.shape)


def within_nf4_error(approx: torch.Tensor, exact: torch.Tensor, block: int) -> bool:
    """NF4's widest gap is 1 - 0.723, so rounding errs by at most 0.139 of the block's absmax;
    the 8-bit absmax adds a little. For Gaussian weights the overall relative error is ~0.09."""
    err = (approx - exact).reshape(-1, block).abs().amax(1)
    absmax = exact.reshape(-1, block).abs().amax(1)
    return bool((err <= 0.2 * absmax).all()) and (approx - exact).norm() < 0.1 * exact.norm()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    data = fast_run({"name": "qlora"}, lr=0.02)
    out = tmp_path_factory.mktemp("qlora") / "straight"
    return data, out, train(load_run(data), out)


def test_qlora_learns_and_trains_only_the_adapters(straight):
    _, out, summary = straight
    assert summary["status"] == "ok" and learns(out)
    assert summary["trainable_params"] == adapter_count("llama_micro", 8) == 19_712


def test_qlora_estimate_equals_the_real_tensors_on_micro(straight):
    data, _, summary = straight
    run = load_run(data)
    estimate = build_memory(run).estimate(param_shapes(run.model, VOCAB), run)
    assert_estimate_matches(estimate, summary)
    assert summary["extra_bytes"] > 0


def test_qlora_resumes_exactly(straight, tmp_path):
    data, out, _ = straight
    assert resumes_exactly(data, tmp_path, out, stop=10)


@pytest.mark.parametrize(
    ("preset", "vocab", "params"),
    [
        ("llama_60m", 32000, {}),
        (
            "llama_micro",
            VOCAB,
            {"block_size": 128, "train_non_targets": True, "compute_dtype": "bf16"},
        ),
    ],
)
def test_qlora_estimate_equals_the_real_tensors(preset, vocab, params):
    estimate, measured = estimate_and_measure({"name": "qlora", **params}, preset, vocab)
    assert estimate == measured
    trainable = adapter_count(preset, 8) + bool(params) * non_target_count(preset, vocab)
    assert measured.grad_bytes == 4 * trainable


def test_targets_are_nf4_with_double_quantization_and_match_the_floats():
    _, model, floats = prepared()
    weights = nf4_weights(model)
    assert sorted(weights) == sorted(floats) and len(weights) == 2 * len(TARGETS)
    for name, w in weights.items():
        qs = w.quant_state
        assert w.dtype == torch.uint8 and w.numel() == floats[name].numel() // 2
        assert (qs.quant_type, qs.blocksize, qs.nested) == ("nf4", 64, True)
        assert not w.requires_grad
        assert within_nf4_error(reference_dequantize(w), floats[name], 64), name


# bitsandbytes 0.50.2's AVX-512 CPU kernel dequantizes wrongly when a row is not a whole number
# of blocks (down_proj: in_features 176); the packed data is right (see the test above). A CPU
# without AVX-512 takes bitsandbytes' other path, which is
# right: expected to fail only where bitsandbytes picks that kernel, by torch's own reading of
# the CPU, as bitsandbytes/backends/cpu/ops.py does. Strict, with bitsandbytes pinned for the
# tests (pyproject's test extra): a release that fixes it turns this into a failure that says
# to drop the mark.
CPU_KERNEL_BUG = pytest.mark.xfail(
    torch.backends.cpu.get_cpu_capability() == "AVX512", strict=True,
    reason="bnb's AVX-512 CPU dequantize_4bit, in_features % block_size != 0")


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=CPU_KERNEL_BUG if k == "down_proj" else ()) for k in TARGETS]
)
def test_bitsandbytes_dequantizes_the_base_within_nf4_error(kind):
    _, model, floats = prepared()
    for name, w in nf4_weights(model).items():
        if f".{kind}." in name:
            assert within_nf4_error(bnbf.dequantize_4bit(w.data, w.quant_state), floats[name], 64)


def test_only_adapters_train_and_the_nf4_weights_never_change():
    method, model, _ = prepared()
    run = load_run(fast_run({"name": "qlora"}))
    weights = nf4_weights(model)
    packed = {n: w.data.clone() for n, w in weights.items()}
    absmax = {n: w.quant_state.absmax.clone() for n, w in weights.items()}
    others = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapters = [p.detach().clone() for p in adapter_params(model)]
    assert {id(p) for p in model.parameters() if p.requires_grad} == set(
        map(id, adapter_params(model))
    )
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(VOCAB, (2, 16))
    for _ in range(3):
        loss_sum(model, ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()  # bnb would repack the weights for its CPU inference kernel here
    with torch.no_grad():
        model(input_ids=ids)
    for n, w in nf4_weights(model).items():
        assert torch.equal(w.data, packed[n]) and torch.equal(w.quant_state.absmax, absmax[n])
    named = dict(model.named_parameters())
    assert all(torch.equal(named[n], p) for n, p in others.items())
    assert all(not torch.equal(p, a) for p, a in zip(adapter_params(model), adapters, strict=True))
    assert len(lora_layers(model)) == len(weights)


def test_checkpoint_restores_the_quantization_constants():
    _, saved, _ = prepared(seed=0)
    _, model, _ = prepared(seed=1)
    model.load_state_dict(saved.state_dict())
    source = nf4_weights(saved)
    for name, w in nf4_weights(model).items():
        assert torch.equal(w.data, source[name].data)
        assert torch.equal(reference_dequantize(w), reference_dequantize(source[name]))
