"""harness/models.py's other source of models: a Hugging Face config or model folder. Three
families written with transformers' own classes (LLaMA with grouped-query attention, Qwen2
with q/k/v biases and tied embeddings, Mistral with a sliding window) train under the methods,
their counted bytes are the estimate's, a folder with weights continues from them, and a bad
`model:` is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    SAMPLE_VOCAB,
    estimated_peak,
    harness,
    measured_peak,
    micro_run,
    train_losses,
    write_yaml,
)
from method_matrix import METHODS

from harness.bench.memory import method_run
from harness.cli import main
from harness.config import RunConfig
from harness.config.steps import Steps
from harness.cost.estimate import estimate_run
from harness.data.c4 import load_tokenizer
from harness.errors import UserError
from harness.methods.base import get_method, method_names
from harness.methods.resolve import load_run
from harness.models import PRESETS, architecture, check_model, param_shapes
from harness.train import train
from harness.train.build import CAUSAL_SDPA, build_model
from harness.train.pretrain import LMData, loss_sum

HIDDEN, INTERMEDIATE, HEAD_DIM = 64, 160, 16  # 4 heads of 16
TINY = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": SAMPLE_VOCAB}  # fmt: skip
KV_HEADS = {"llama_gqa": 2, "qwen2": 2, "mistral": 1}
WINDOW = 16  # Mistral's, shorter than the runs' 32-token sequences


def hf_config(family: str, **extra: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    keys = {**TINY, "num_key_value_heads": KV_HEADS[family], **extra}
    if family == "llama_gqa":
        return LlamaConfig(**keys)
    if family == "qwen2":  # q/k/v biases are Qwen2's own
        return Qwen2Config(**{"tie_word_embeddings": True, **keys})
    return MistralConfig(**{"sliding_window": WINDOW, **keys})


def write_config(folder: Path, family: str, **extra: Any) -> str:
    hf_config(family, **extra).save_pretrained(folder)
    return str(folder)


def hf_run(model: str, steps: int = 2, method: dict[str, Any] | None = None,
           **train_keys: Any) -> RunConfig:
    data = micro_run(steps=steps, **train_keys)
    data.update(model=model, eval={"every": 0, "tokens": 64}, method=method or {"name": "full"})
    return load_run(data)


def qwen2_params() -> int:
    """Counted by hand: a tied 8192 x 64 embedding, per layer q (64x64 + 64), k and v
    (32x64 + 32 each), o (64x64), gate, up, down (3 x 64x160), two norms (64 each), a final
    norm."""
    layer = (64 * 64 + 64) + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 160 + 2 * 64
    return SAMPLE_VOCAB * 64 + 2 * layer + 64


def test_each_family_is_described_as_its_config_says(tmp_path):
    for family, kv in KV_HEADS.items():
        model = write_config(tmp_path / family, family)
        arch = architecture(model)
        assert (arch.hidden, arch.intermediate, arch.layers, arch.heads) == (64, 160, 2, 4)
        assert (arch.kv_heads, arch.head_dim, arch.vocab) == (kv, HEAD_DIM, SAMPLE_VOCAB)
        assert arch.tied == (family == "qwen2")
        assert arch.window == (WINDOW if family == "mistral" else None)
        shapes = param_shapes(model, SAMPLE_VOCAB)
        assert shapes["model.layers.1.self_attn.k_proj.weight"] == (kv * HEAD_DIM, HIDDEN)
        assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == (family == "qwen2")
        assert ("lm_head.weight" in shapes) == (family != "qwen2")
    assert sum(s.numel() for s in param_shapes(str(tmp_path / "qwen2"), 100).values()) == (
        qwen2_params())


def test_a_window_shorter_than_the_sequence_keeps_sdpa_and_is_honoured(tmp_path):
    """causal_sdpa builds no mask, so it would let every position see every earlier one."""
    mistral = write_config(tmp_path / "mistral", "mistral")
    llama = write_config(tmp_path / "llama", "llama_gqa")
    assert build_model(llama, SAMPLE_VOCAB, 32, 0).config._attn_implementation == CAUSAL_SDPA
    assert build_model(mistral, SAMPLE_VOCAB, WINDOW, 0).config._attn_implementation == (
        CAUSAL_SDPA)  # the window covers the sequence: nothing to mask
    torch.manual_seed(0)
    model = build_model(mistral, SAMPLE_VOCAB, 32, 0)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, SAMPLE_VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 0] += 1
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
    # two layers of a 16-token window: position 31 reads 16..31, which read 1..31 — not 0
    torch.testing.assert_close(a[0, 31], b[0, 31])
    assert not torch.allclose(a[0, 30], b[0, 30])  # 30 reads 15, which read 0


def test_from_scratch_is_seeded_as_the_presets_are(tmp_path):
    model = write_config(tmp_path / "qwen2", "qwen2")

    def seeded(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(model, SAMPLE_VOCAB, 32, 0)

    a, b, c = seeded(3), seeded(3), seeded(4)
    assert next(a.parameters()).dtype == torch.float32
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(x, y), name
        if x.dim() == 2:
            assert not torch.equal(x, z), name


BYTES = {"weight_bytes": "param_bytes", "grad_bytes": "grad_bytes",
         "optimizer_state_bytes": "optimizer_state_bytes", "extra_bytes": "extra_bytes"}
ESTIMATED = {"full": {"name": "full"}, "relora": METHODS["relora"], "galore": METHODS["galore"]}
PRETRAINING = [name for name in method_names() if "pretrain" in get_method(name).tasks]
# The quick tier keeps a diagonal of the families x methods grid (each family and each method
# once), and on Qwen2 the methods that replace, quantize or split what its biases and tied head
# touch; the rest run in the integration tier (tests/tiers.py), as CI runs it.
QUICK = {
    "test_a_config_trains_and_its_bytes_are_the_estimates": {
        ("llama_gqa", "relora"), ("qwen2", "galore"), ("mistral", "full")},
    "test_every_pretraining_method_trains_a_qwen2_config": {
        (method,) for method in ("relora", "lowrank", "qgalore", "adam_mini", "muon")},
}
# Optimizers that treat each tensor by its shape alone, reading no name: Qwen2's q/k/v biases
# are 1-D tensors as every LLaMA's norm weights, and its tied head one 2-D tensor fewer, so
# their LLaMA runs cover them; `pytest --exhaustive` runs them on Qwen2 too (tests/tiers.py).
EXHAUSTIVE = {"test_every_pretraining_method_trains_a_qwen2_config": {
    (method,) for method in ("adam8bit", "adam4bit", "lion", "schedule_free", "ademamix", "mars",
                             "came", "stable_spam", "soap")}}


@pytest.mark.parametrize("method", ESTIMATED)
@pytest.mark.parametrize("family", KV_HEADS)
def test_a_config_trains_and_its_bytes_are_the_estimates(tmp_path, family, method):
    run = hf_run(write_config(tmp_path / family, family), method=ESTIMATED[method])
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    losses = train_losses(tmp_path / "t")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    estimate = estimate_run(run)
    assert {k: estimate[k] for k in BYTES} == {k: summary[v] for k, v in BYTES.items()}


@pytest.mark.parametrize("method", PRETRAINING)
def test_every_pretraining_method_trains_a_qwen2_config(tmp_path, method):
    """GQA, q/k/v biases and a tied head at once."""
    run = hf_run(write_config(tmp_path / "qwen2", "qwen2"), method=METHODS[method])
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert all(math.isfinite(v) for v in train_losses(tmp_path / "t").values())


def first_step_loss(model: torch.nn.Module, run: RunConfig) -> float:
    """The model's mean loss over the batches the run's first step takes (its micro-batches
    from the run's seeded stream), the mean the trainer logs for step 1."""
    tok = load_tokenizer(run.task.tokenizer)
    steps = Steps.of(run.train, run.task.seq_len, 1)
    data = LMData(run, tok, torch.device("cpu"), steps)
    try:
        batches = [data.next()[0] for _ in range(steps.accumulation)]
    finally:
        data.close()
    with torch.no_grad():
        total = sum(float(loss_sum(model, *b)) for b in batches)
    return total / sum(int(data.count(b)) for b in batches)


def test_continued_pretraining_starts_from_the_saved_weights(tmp_path):
    """Weights saved in bfloat16 (the usual checkpoint dtype): the first step's loss is theirs,
    in float32; the same config.json alone (a fresh init from the run's seed) is far from it."""
    from transformers import LlamaForCausalLM

    config = hf_config("llama_gqa", initializer_range=0.5)  # wide: two inits lie far apart
    torch.manual_seed(7)
    saved = LlamaForCausalLM(config).to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "pretrained")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tmp_path / "pretrained" / "config.json").read_text())
    reference = LlamaForCausalLM(config)  # float32 (RoPE's frequencies too), the saved values
    reference.load_state_dict(saved.state_dict())
    expected = first_step_loss(reference, hf_run(str(tmp_path / "pretrained")))
    for folder in ("pretrained", "config_only"):
        run = hf_run(str(tmp_path / folder), steps=1)
        summary = train(run, tmp_path / folder / "t")
        assert summary["status"] == "ok", summary["error"]
        first = train_losses(tmp_path / folder / "t")[1]
        if folder == "pretrained":
            assert first == pytest.approx(expected, rel=1e-5)
            n = sum(p.numel() for p in saved.parameters())
            assert summary["param_bytes"] == 4 * n  # float32, as the presets are built
        else:
            assert abs(first - expected) > 0.1


def test_the_estimated_peak_counts_k_and_v_at_kv_heads(tmp_path):
    """A llama_tiny-sized LLaMA with 8 heads and 2 of k/v: a step's measured peak is the
    estimate's to 0.5%. Counting k and v hidden-wide, as for the presets, would add 2·4·(256 -
    64) bytes a token and layer: 3.1 MB of its 176 MB, 1.8%."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=SAMPLE_VOCAB,
                rms_norm_eps=1e-6).save_pretrained(tmp_path / "gqa")
    run = method_run("full", str(tmp_path / "gqa"), 3, 128, 4, {"device": "cpu"})
    measured, _ = measured_peak(run)
    assert abs(measured / estimated_peak(run) - 1) <= 0.005


def test_a_bad_model_is_one_line_naming_it_and_what_is_allowed(tmp_path):
    from transformers import GPT2Config, T5Config

    allowed = "allowed: a preset (llama_micro, "
    cases = {
        str(tmp_path / "nope"): f"model: no such file or folder '{tmp_path / 'nope'}'; {allowed}",
        str(tmp_path): f"model: the folder '{tmp_path}' holds no config.json; {allowed}",
        "some-org/some-model": "model: unknown model preset 'some-org/some-model' (allowed: "
        f"{', '.join(PRESETS)}); 'some-org/some-model' is not in the local Hugging Face cache "
        "and the hub cannot be reached (offline: ",  # offline here
    }
    GPT2Config(n_embd=64, n_layer=2, n_head=4).save_pretrained(tmp_path / "gpt2")
    cases[str(tmp_path / "gpt2")] = f"model: '{tmp_path / 'gpt2'}' is a gpt2 without LLaMA's layout"
    T5Config(d_model=64, num_layers=2).save_pretrained(tmp_path / "t5")
    cases[str(tmp_path / "t5")] = f"model: '{tmp_path / 't5'}' (t5) is not a causal LM"
    for model, start in cases.items():
        with pytest.raises(UserError) as e:
            check_model(RunConfig(model=model))
        assert str(e.value).startswith(start) and "\n" not in str(e.value)
    check_model(RunConfig(model=write_config(tmp_path / "ok", "qwen2")))
    check_model(RunConfig(model=str(tmp_path / "ok" / "config.json")))  # the file itself


def test_a_bad_model_stops_harness_train_with_one_line(tmp_path):
    write_config(tmp_path / "small", "llama_gqa", vocab_size=1000)
    cases = {
        str(tmp_path / "nope"): f"error: model: no such file or folder '{tmp_path / 'nope'}'",
        str(tmp_path): f"error: model: the folder '{tmp_path}' holds no config.json",
        str(tmp_path / "small"): f"error: model: '{tmp_path / 'small'}' has vocab_size 1000, "
                                 f"fewer than the tokenizer's {SAMPLE_VOCAB} tokens",
    }
    for i, (model, start) in enumerate(cases.items()):
        config = write_yaml(tmp_path / f"run{i}.yaml", {**micro_run(steps=1), "model": model})
        done = harness("train", str(config), "--out", str(tmp_path / f"out{i}"))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(start) and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stdout + done.stderr


def test_a_sweep_whose_tokenizer_overflows_the_config_is_refused_before_any_trial(tmp_path,
                                                                                  capsys):
    small = write_config(tmp_path / "small", "llama_gqa", vocab_size=1000)
    sweep = {"name": "v", "model": small, "methods": {"full": {}},
             **{k: v for k, v in micro_run(steps=1).items() if k in ("task", "train")}}
    path = write_yaml(tmp_path / "sweep.yaml", sweep)
    assert main(["sweep", str(path), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: model: '{small}' has vocab_size 1000, fewer than the tokenizer's "
                   f"{SAMPLE_VOCAB} tokens; use a tokenizer (task.tokenizer) of at most 1000 "
                   "tokens, or a config whose vocab_size holds it")
    assert not (tmp_path / "runs").exists()


def test_harness_estimate_takes_a_config_folder(tmp_path, capsys):
    """Full AdamW's bytes of the hand-counted Qwen2: float32 weights and gradients, two
    moments and a float32 step for each of its 26 tensors."""
    model = write_config(tmp_path / "qwen2", "qwen2")
    sweep = write_yaml(tmp_path / "sweep.yaml", {
        "name": "hf", "model": model,
        "task": {"dataset": "sample", "tokenizer": "sample", "seq_len": 32},
        "train": {"steps": 2, "batch_size": 2},
        "methods": {"full": {}, "galore": {"rank": 8}},
    })  # fmt: skip
    assert main(["estimate", str(sweep), "--json"]) == 0
    records = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    n = qwen2_params()
    full = records["full"]
    assert (full["weight_bytes"], full["grad_bytes"]) == (4 * n, 4 * n)
    assert full["optimizer_state_bytes"] == 8 * n + 4 * 26
    assert 0 < records["galore"]["optimizer_state_bytes"] < full["optimizer_state_bytes"]


def test_harness_plan_takes_a_config_folder(tmp_path, capsys):
    model = write_config(tmp_path / "qwen2", "qwen2", max_position_embeddings=64)
    flags = ["--memory", "1GB", "--tokenizer", "sample", "--token-batch", "64"]
    assert main(["plan", model, *flags, "--seq-len", "32", "--json"]) == 0
    fits = json.loads(capsys.readouterr().out)["fits"]
    plain = next(c for c in fits if (c["label"], c["modifiers"], c["precision"], c["micro_batch"])
                 == ("full", "", "32-true", 2))
    n = qwen2_params()
    assert plain["breakdown"]["weight_bytes"] == plain["breakdown"]["grad_bytes"] == 4 * n
    assert main(["plan", model, *flags, "--seq-len", "128"]) == 2
    assert capsys.readouterr().err == f"error: --seq-len 128: {model} takes at most 64\n"
    assert main(["plan", model, "--memory", "1GB", "--seq-len", "32"]) == 2  # t5-base's 32100
    assert "has vocab_size 8192, fewer than the tokenizer's 32100" in capsys.readouterr().err
