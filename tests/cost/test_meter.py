"""harness/cost/meter.py: weight counts (packed 4-bit and INT8 weights as weights), the FLOP
count behind MFU, the memory readings on CPU, and the training clock's laps."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_run
from torch import nn

from harness.cost import meter
from harness.cost.grad_peak import GradPeak
from harness.cost.meter import (
    Meter,
    breakdown,
    current_memory,
    flops_per_token,
    logical_numel,
    peak_flops,
    peak_memory,
    weight_counts,
)
from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.quant import Int8Linear
from harness.methods.resolve import load_run

CPU = torch.device("cpu")


def test_no_peak_flops_on_a_cpu_so_no_mfu():
    assert peak_flops(CPU, "bf16-mixed") is None and peak_flops(CPU, "32-true") is None
    assert meter.PEAK_FLOPS["H100"]["bf16"] == 989e12


def test_flops_per_token_is_palms_count(tiny_model):
    """Every weight trained: 6 FLOPs a token each."""
    n = sum(p.numel() for p in tiny_model.parameters()) - SAMPLE_VOCAB * 64  # no input embedding
    assert flops_per_token(tiny_model, 32) == 6 * n + 12 * 2 * 64 * 32
    assert flops_per_token(tiny_model, 64) - flops_per_token(tiny_model, 32) == 12 * 2 * 64 * 32


@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_frozen_weights_count_4_flops_a_token_trained_ones_6(name):
    """A frozen weight's backward computes its input's gradient only: 4 FLOPs, not 6."""
    from conftest import micro_model

    run = load_run({**micro_run(), "method": {"name": name, "rank": 4}})
    model = build_method(run).prepare(micro_model(), run)
    embedding = model.get_input_embeddings().weight  # a lookup: no FLOPs, trained or not
    params = [p for p in model.parameters() if p is not embedding]
    trained = sum(logical_numel(p) for p in params if p.requires_grad)
    frozen = sum(logical_numel(p) for p in params if not p.requires_grad)
    assert frozen > 0 and trained > 0
    assert flops_per_token(model, 32) == 6 * trained + 4 * frozen + 12 * 2 * 64 * 32


def test_weight_counts_split_trained_and_all(tiny_model):
    n = sum(p.numel() for p in tiny_model.parameters())
    assert weight_counts(tiny_model) == (n, n)
    tiny_model.lm_head.weight.requires_grad_(False)
    assert weight_counts(tiny_model) == (n - SAMPLE_VOCAB * 64, n)


def test_int8_weights_are_trained_weights_though_buffers():
    model = nn.ModuleDict({"q": Int8Linear.from_linear(nn.Linear(64, 32, bias=True)),
                           "norm": nn.LayerNorm(32)})
    assert [n for n, _ in model.named_parameters()] == ["q.bias", "norm.weight", "norm.bias"]
    assert weight_counts(model) == (32 * 64 + 32 + 64, 32 * 64 + 32 + 64)


def test_a_packed_4bit_tensor_counts_its_weights_not_its_bytes():
    import bitsandbytes as bnb

    linear = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4")
    linear.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
    linear = linear.to("cpu")  # quantizes: two weights a byte
    assert linear.weight.numel() == 64 * 64 // 2
    assert logical_numel(linear.weight) == 64 * 64
    assert logical_numel(torch.zeros(3, 5)) == 15
    assert weight_counts(linear) == (0, 64 * 64)


def test_cpu_memory_is_the_process_rss_and_its_peak_kept_apart_from_the_tensor_peak():
    now = current_memory(CPU)
    peak = peak_memory(CPU)
    assert set(peak) == {"peak_rss_bytes"}  # peak_memory_bytes: live tensors (tensor_peak.py)
    assert now > 10e6  # a Python process with torch: more than 10 MB
    assert peak["peak_rss_bytes"] >= 0.9 * now  # the kernel updates its high-water lazily


def test_breakdown_counts_full_adamw_after_a_step(tiny_model):
    run = load_run(micro_run())
    method = build_method(run)
    optimizer = optimizer_for(method, tiny_model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (1, 8))
    watch = GradPeak(tiny_model, optimizer)
    tiny_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    n = sum(p.numel() for p in tiny_model.parameters())
    tensors = len(list(tiny_model.parameters()))
    assert breakdown(memory_of(method), tiny_model, optimizer, watch.close()) == {
        "param_bytes": 4 * n, "grad_bytes": 4 * n,
        "optimizer_state_bytes": 8 * n + 4 * tensors,  # two fp32 moments and a step each
        "extra_bytes": 0, "trainable_params": n, "total_params": n}


class Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:  # the wall clock, 1,000,000 s ahead of the counter
        return self.now + 1e6


def test_meter_counts_only_steady_training_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(meter, "time", types.SimpleNamespace(perf_counter=clock.perf_counter,
                                                             time=clock.time))
    m = Meter(CPU)
    assert m.tokens_per_s is None
    m.add(100)
    clock.now += 2
    assert m.lap() == (2.0, 50.0)
    m.add(30)
    clock.now += 1
    m.pause()  # an eval: 7 s that are not training
    clock.now += 7
    m.resume()
    m.add(30)
    clock.now += 2
    assert m.lap(steady=False) == (3.0, 20.0)  # a first step's lap, not counted toward tok/s
    assert (m.train_s, m.tokens) == (2.0, 100)
    assert m.lap() == (3.0, 20.0)  # nothing added since: the last lap again, nothing counted
    m.add(400)
    clock.now += 4
    assert m.lap() == (4.0, 100.0)
    assert m.tokens_per_s == pytest.approx(500 / 6)


def test_the_meter_records_the_load_and_the_span_its_tok_s_was_measured_over(monkeypatch):
    """Each counted lap samples the 1-minute load average; a first step's lap does not. The
    span runs from the first counted lap's start to the last one's end, pauses included."""
    clock, loads = Clock(), iter([1.5, 2.5])  # a third sample would raise
    monkeypatch.setattr(meter, "time", types.SimpleNamespace(perf_counter=clock.perf_counter,
                                                             time=clock.time))
    monkeypatch.setattr(meter, "os", types.SimpleNamespace(
        getloadavg=lambda: (next(loads), 0.0, 0.0), cpu_count=lambda: 2))
    m = Meter(CPU)
    assert m.conditions() == {"load_average": None, "cpu_count": 2, "measured_from": None,
                              "measured_to": None}
    m.add(10)
    clock.now += 1  # 101: the first step, not counted
    m.lap(steady=False)
    m.add(100)
    clock.now += 2  # 103
    m.lap()
    m.pause()
    clock.now += 7  # 110: an eval
    m.resume()
    m.add(100)
    clock.now += 3  # 113
    m.lap()
    assert m.conditions() == {"load_average": 2.0, "cpu_count": 2,
                              "measured_from": 1e6 + 101, "measured_to": 1e6 + 113}


def test_a_trials_summary_says_where_its_tok_s_was_measured(finished_run):
    """The shared finished sweep's trials (two at a time, one process each): the load, the
    cores and the measured span, inside the trial's own lifetime."""
    for path in sorted((finished_run / "trials").glob("*/summary.json")):
        summary = json.loads(path.read_text())
        assert summary["processes"] == 1 and summary["cpu_count"] == os.cpu_count()
        assert summary["load_average"] >= 0
        start, end = summary["measured_from"], summary["measured_to"]
        assert summary["first_step_at"] < start < end
        assert end <= summary["started_at"] + summary["wall_s"]


def test_mfu_divides_every_ranks_tokens_by_every_ranks_peak(monkeypatch, tmp_path):
    """tokens/s counts the tokens of all W data-parallel ranks; the peak is one device's, so
    MFU divides by W peaks (a CPU has no peak: one is stood in for here)."""
    import dataclasses

    from harness.train import Trainer
    from harness.trials import Records

    monkeypatch.setattr(meter, "peak_flops", lambda device, precision: 1e12)
    run = load_run(micro_run(steps=3))
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    try:
        trainer.meter.tokens, trainer.meter.train_s = 1000, 2.0
        one = trainer.results()["mfu"]
        assert one == pytest.approx(500 * trainer.flops_per_token / 1e12)
        trainer.steps = dataclasses.replace(trainer.steps, world=4)
        assert trainer.results()["mfu"] == pytest.approx(one / 4)
    finally:
        trainer.close()


@pytest.mark.parametrize(("name", "bf16", "fp32", "tf32"), [
    ("NVIDIA H100 80GB HBM3", 989e12, 67e12, 494.7e12),  # SXM; TF32 989.4 with sparsity
    ("NVIDIA H100 PCIe", 756e12, 51e12, 378e12),
    ("NVIDIA H100 NVL", 835e12, 60e12, 417.5e12),
    ("NVIDIA H200", 989e12, 67e12, 494.7e12),
    ("NVIDIA H200 NVL", 835e12, 60e12, 417.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 19.5e12, 156e12),
    ("NVIDIA L40S", 362e12, 91.6e12, 183e12),
    ("Tesla T4", None, None, None),
])
def test_the_peak_is_the_named_parts_own(monkeypatch, name, bf16, fp32, tf32):
    """Matched by the device's name: a PCIe or NVL part gets its own peak, not the SXM one.
    TF32 (dense, from the datasheets) applies to 32-true's float32 matmuls only; by default
    the peak follows torch's switch (tests/modifiers/test_kernels.py)."""
    monkeypatch.setattr(meter.torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda")
    assert peak_flops(cuda, "bf16-true") == bf16 and peak_flops(cuda, "16-mixed") == bf16
    assert peak_flops(cuda, "32-true") == fp32
    assert peak_flops(cuda, "32-true", tf32=True) == tf32
    assert peak_flops(cuda, "32-true", tf32=False) == fp32
    assert peak_flops(cuda, "bf16-true", tf32=True) == bf16
    assert peak_flops(CPU, "32-true", tf32=True) is None


def test_a_padded_llama_presets_flops_follow_its_mlp_width():
    """MFU's FLOPs come from the built model. LLaMA-1B padded to 5504 (h 2048, 24 layers,
    vocab 32000), counted by hand: 24 x (4h^2 + 3h x 5504 + 2h) + h (final norm) + 32000h (head)
    = 1,279,887,360 trained non-embedding weights; x 6, plus 12 x 24 x h x 256 for attention."""
    from harness.config import ModelOptions
    from harness.train.build import build_model

    with torch.device("meta"):
        padded = build_model("llama_1b", 32000, 256, None, ModelOptions(mlp_multiple_of=64))
        paper = build_model("llama_1b", 32000, 256, None)
    assert flops_per_token(padded, 256) == 6 * 1_279_887_360 + 150_994_944 == 7_830_319_104
    # 43 more columns in each of 72 MLP matrices of 2048: 6 x 6,340,608
    assert flops_per_token(padded, 256) - flops_per_token(paper, 256) == 38_043_648


def test_the_trials_model_is_built_at_its_model_options_width():
    """pretrain.build, which the trial's Trainer counts FLOPs from: llama_micro's 176 padded to
    192 adds 2 layers x 3 matrices x 64 x 16 weights, 6 FLOPs a token each."""
    from harness.train import pretrain

    plain = pretrain.build(load_run(micro_run()))[0]
    padded = pretrain.build(load_run({**micro_run(), "model_options": {"mlp_multiple_of": 64}}))[0]
    assert padded.config.intermediate_size == 192
    assert flops_per_token(padded, 32) - flops_per_token(plain, 32) == 6 * 2 * 3 * 64 * 16
