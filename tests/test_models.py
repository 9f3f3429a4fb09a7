"""harness/models.py and harness/train/build.py: the presets become the LLaMA the papers
train, shapes come without memory, and the causal attention the trainer registers computes
what eager attention does."""

from __future__ import annotations

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_model

from harness.config import ModelFrom, ModelOptions, RunConfig, TaskConfig
from harness.errors import UserError
from harness.models import PRESETS, architecture, check_model, check_preset, param_shapes
from harness.train.build import CAUSAL_SDPA, build_model, describe, generation_ready, llama_config


def test_tiny_model_fixture_is_llama_micro_on_the_sample_vocab(tiny_model):
    p = PRESETS["llama_micro"]
    config = tiny_model.config
    assert (config.hidden_size, config.intermediate_size) == (p.hidden, p.intermediate)
    assert (config.num_hidden_layers, config.num_attention_heads) == (p.layers, p.heads)
    assert config.vocab_size == SAMPLE_VOCAB
    assert config._attn_implementation == CAUSAL_SDPA
    per_layer = 4 * p.hidden**2 + 3 * p.hidden * p.intermediate + 2 * p.hidden
    n = 2 * SAMPLE_VOCAB * p.hidden + p.layers * per_layer + p.hidden  # untied head, final norm
    assert sum(t.numel() for t in tiny_model.parameters()) == n == 1_149_248


def test_llama_config_follows_galore():
    config = llama_config("llama_60m", 32000, 256, pad_id=0)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        512, 1376, 8)
    assert config.num_key_value_heads == config.num_attention_heads == 8
    assert config.rms_norm_eps == 1e-6 and config.hidden_act == "silu"
    assert config.initializer_range == 0.02 and config.tie_word_embeddings is False
    assert config.pad_token_id == 0 and config.use_cache is False
    assert config.max_position_embeddings == 1024  # the preset's, longer than seq_len
    assert llama_config("llama_micro", 100, 4096, None).max_position_embeddings == 4096
    assert llama_config("llama_7b", 100, 256, None).max_position_embeddings == 2048


def test_param_shapes_match_the_built_model_without_allocating():
    shapes = param_shapes("llama_micro", SAMPLE_VOCAB)
    built = [(n, p.shape) for n, p in micro_model().named_parameters()]
    assert list(shapes.items()) == built  # names, shapes and order
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 176)
    assert shapes["lm_head.weight"] == (SAMPLE_VOCAB, 64)
    big = param_shapes("llama_7b", 32000)  # written out: 6.7B parameters in no memory
    assert sum(s.numel() for s in big.values()) == 6_738_415_616  # LLaMA-7B's count at 32,000


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_presets_written_shapes_are_the_ones_transformers_builds(preset):
    """The cost model reads the shapes without importing transformers' modeling; transformers,
    building the preset on the meta device, is the reference."""
    with torch.device("meta"):
        built = build_model(preset, 32100, 256, None)
    assert list(param_shapes(preset, 32100).items()) == [
        (n, p.shape) for n, p in built.named_parameters()]


def test_seeded_builds_are_identical_and_seeds_differ():
    a, b, c = micro_model(seed=3), micro_model(seed=3), micro_model(seed=4)
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(x, y), name
        if x.dim() == 2:
            assert not torch.equal(x, z), name


def test_causal_sdpa_equals_eager_causal_attention(tiny_model):
    """No mask is built for the registered attention: causality must come from is_causal."""
    from transformers import LlamaForCausalLM

    eager = LlamaForCausalLM(llama_config("llama_micro", SAMPLE_VOCAB, 32, None, "eager"))
    eager.load_state_dict(tiny_model.state_dict())
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = tiny_model(input_ids=ids).logits, eager(input_ids=ids).logits
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
        # causal: changing the last token leaves every earlier position's logits unchanged
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % SAMPLE_VOCAB
        later = tiny_model(input_ids=changed).logits
    torch.testing.assert_close(later[:, :-1], ours[:, :-1])
    assert not torch.allclose(later[:, -1], ours[:, -1])


def test_describe_counts_parameters_with_and_without_embeddings(tiny_model):
    assert describe(tiny_model) == "1.15M parameters (0.62M without input embeddings)"


def test_unknown_preset_is_a_user_error_with_a_suggestion():
    assert check_preset("llama_tiny", "model") is PRESETS["llama_tiny"]
    with pytest.raises(UserError, match=r"^model: unknown model preset 'llama_1B' \(did you "
                                        r"mean 'llama_1b'\? allowed: llama_micro, "):
        check_preset("llama_1B", "model")
    with pytest.raises(UserError, match=r"^model: (unknown model preset 'gpt2'|'gpt2' is a gpt2)"):
        build_model("gpt2", 100, 8, None)  # a hub name: offline here, not LLaMA's layout there


def test_check_model_pretraining_needs_a_decoder_and_glue_takes_a_checkpoint():
    """Pretraining takes a preset or a LLaMA-layout decoder's config (tests/test_hf_models.py);
    a hub encoder is refused, offline because the hub is out of reach, online by its layout."""
    check_model(RunConfig(model="llama_micro"))
    with pytest.raises(UserError, match=r"^model: (unknown model preset|'roberta-base' is a)"):
        check_model(RunConfig(model="roberta-base"))
    source = ModelFrom(**{"from": "runs/pretrain"})
    with pytest.raises(UserError, match=r"model: \{from: \.\.\.\} fine-tunes a checkpoint"):
        check_model(RunConfig(model=source))
    check_model(RunConfig(model=source, task=TaskConfig(kind="glue")))  # resolved later
    check_model(RunConfig(model="roberta-base", task=TaskConfig(kind="glue")))


def test_a_tokenizer_without_bos_or_pad_generates_with_eos_padding():
    """t5-base's layout: no BOS, pad 0, EOS 1; and one with no pad at all (GPT-2's): the
    generation config pads with EOS, as training's packer does; the model's own pad id (its
    embedding's padding row, set at build) is left as built. A classifier is left alone."""
    from types import SimpleNamespace

    from transformers import LlamaForSequenceClassification

    t5 = SimpleNamespace(bos_token_id=None, eos_token_id=1, pad_token_id=0)
    gpt2 = SimpleNamespace(bos_token_id=50256, eos_token_id=50256, pad_token_id=None)
    for tok, pad in ((t5, 0), (gpt2, 50256)):
        model = build_model("llama_micro", 60_000, 16, tok.pad_token_id)
        generation_ready(model, tok)
        g, c = model.generation_config, model.config
        assert (g.bos_token_id, g.eos_token_id, g.pad_token_id, g.use_cache) == (
            tok.bos_token_id, tok.eos_token_id, pad, True)
        assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.use_cache) == (
            tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, True)
    classifier = LlamaForSequenceClassification(llama_config("llama_micro", 100, 16, 0))
    generation_ready(classifier, t5)
    assert classifier.config.eos_token_id == 2 and classifier.config.use_cache is False


def test_mlp_multiple_of_pads_a_presets_mlp_for_every_reader():
    """LLaMA-1B's 5461 rounded up to a multiple of 64 is 86 x 64 = 5504; llama_micro's 176 is
    already 11 x 16, and 3 x 64 = 192 is the next multiple of 64. Shapes, architecture and the
    built model (on the meta device) all follow; without options, the paper's widths."""
    pad = ModelOptions(mlp_multiple_of=64)
    assert architecture("llama_1b").intermediate == 5461
    assert architecture("llama_1b", pad).intermediate == 5504
    shapes = param_shapes("llama_1b", 32000, pad)
    assert shapes["model.layers.23.mlp.gate_proj.weight"] == (5504, 2048)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (2048, 5504)
    assert sum(s.numel() for s in shapes.values()) - sum(
        s.numel() for s in param_shapes("llama_1b", 32000).values()) == 24 * 3 * 2048 * 43
    assert param_shapes("llama_micro", 100, ModelOptions(mlp_multiple_of=16)) == param_shapes(
        "llama_micro", 100)
    with torch.device("meta"):
        built = build_model("llama_micro", 100, 16, None, ModelOptions(mlp_multiple_of=64))
    assert built.config.intermediate_size == 192
    assert list(param_shapes("llama_micro", 100, ModelOptions(mlp_multiple_of=64)).items()) == [
        (n, p.shape) for n, p in built.named_parameters()]
    assert llama_config("llama_1b", 100, 256, None, options=pad).intermediate_size == 5504


def test_intermediate_size_sets_a_presets_mlp_width_outright():
    wide = ModelOptions(intermediate_size=200)
    assert architecture("llama_micro", wide).intermediate == 200
    assert param_shapes("llama_micro", 100, wide)["model.layers.1.mlp.up_proj.weight"] == (200, 64)
    assert check_preset("llama_micro", "model", wide).intermediate == 200
    assert PRESETS["llama_micro"].intermediate == 176  # the preset itself is left as it is


def test_width_options_are_refused_where_the_model_has_its_own_width(tmp_path):
    """An HF config's width is the config's; fine-tuning builds the checkpoint's or the
    encoder's; liger's Triton kernels do not run on a CPU run. One line each."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                num_attention_heads=2, vocab_size=128).save_pretrained(tmp_path)
    pad = {"mlp_multiple_of": 64}
    with pytest.raises(UserError, match=r"^model_options.mlp_multiple_of: '.*' is not a preset; "
                                        r"its MLP width is its config's: edit the config's "
                                        r"intermediate_size instead"):
        check_model(RunConfig(model=str(tmp_path), model_options=pad))
    with pytest.raises(UserError, match=r"^model_options.intermediate_size: '.*' is not a "):
        param_shapes(str(tmp_path), 100, ModelOptions(intermediate_size=256))
    check_model(RunConfig(model=str(tmp_path)))  # without the option it loads
    source = ModelFrom(**{"from": "runs/pretrain"})
    glue = TaskConfig(kind="glue")
    with pytest.raises(UserError, match=r"^model_options.mlp_multiple_of: applies to "
                                        r"pretraining only"):
        check_model(RunConfig(model=source, task=glue, model_options=pad))
    with pytest.raises(UserError, match=r"^train.tf32: applies to pretraining only"):
        check_model(RunConfig(model=source, task=glue, train={"tf32": True}))
    with pytest.raises(UserError, match=r"^model_options.kernels liger: applies to pretraining"):
        check_model(RunConfig(model=source, task=glue, model_options={"kernels": "liger"}))
    with pytest.raises(UserError, match=r"^model_options.kernels: liger runs Triton kernels on "
                                        r"CUDA, and this run's device is cpu"):
        check_model(RunConfig(model="llama_micro", device="cpu",
                              model_options={"kernels": "liger"}))
    check_model(RunConfig(model="llama_micro", model_options=pad, train={"tf32": True}))
