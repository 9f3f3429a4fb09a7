"""The model a trial trains, built: a preset's LLaMA (GaLore's configs) or a Hugging Face
config or model (harness/models.py describes and checks both), with the `causal_sdpa`
attention, and the ids a causal LM generates with."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from harness.config import ModelOptions
from harness.config.hub import offline
from harness.models import PRESETS, HFModel, check_preset, fit_vocab, hf_model, no_width

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CAUSAL_SDPA = "causal_sdpa"


def register_causal_sdpa() -> str:
    """transformers' sdpa under a name it has no mask function for. No mask is then built, so
    sdpa runs with is_causal=True (the flash kernels) as with "sdpa" on unpadded input, and the
    check for packed sequences that "sdpa" runs in every forward (a read of a device value: a
    host sync per micro-batch on a GPU) is skipped. Right only where no padding mask is needed:
    causal LM on packed blocks, whose padding sits after the last real token."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def llama_config(name: str, vocab_size: int, seq_len: int, pad_id: int | None,
                 attention: str = "sdpa", options: ModelOptions | None = None,
                 **extra: Any) -> Any:
    """GaLore's configs (RMSNorm eps 1e-6, SiLU, untied head), at `options`' MLP width."""
    from transformers import LlamaConfig

    p = check_preset(name, "model", options)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        max_position_embeddings=max(p.max_seq_len, seq_len),
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        use_cache=False,
        attn_implementation=attention,
        **extra,
    )


def build_model(name: str, vocab_size: int, seq_len: int, pad_id: int | None,
                options: ModelOptions | None = None, weights: bool = True) -> PreTrainedModel:
    """The model to pretrain, random-init from the caller's seed or, from a folder (or hub
    model) with weights, those weights in float32 (`weights` False: its skeleton, to fill).
    `vocab_size`: the tokenizer's length, a preset's embedding sized to it, an HF config's
    holding it. `options`: the run's model_options (a preset's MLP width)."""
    if name in PRESETS:
        from transformers import LlamaForCausalLM

        config = llama_config(name, vocab_size, seq_len, pad_id, attention=register_causal_sdpa(),
                              options=options)
        return LlamaForCausalLM(config)
    no_width(name, options)
    hf = hf_model(name) if weights else replace(hf_model(name), weights=None)
    return _build_hf(hf, name, vocab_size, seq_len, pad_id)


def _build_hf(hf: HFModel, name: str, vocab_size: int, seq_len: int,
              pad_id: int | None) -> PreTrainedModel:
    """causal_sdpa as the presets use, unless a sliding window shorter than the sequence needs
    sdpa's mask; the tokenizer's pad id as the embedding's padding row, as the presets do."""
    from transformers import AutoModelForCausalLM

    fit_vocab(name, vocab_size)
    config = copy.deepcopy(hf.config)
    config.use_cache = False
    if pad_id is not None:
        config.pad_token_id = pad_id
    attention = "sdpa" if hf.arch.windowed(seq_len) else register_causal_sdpa()
    if hf.weights is None:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=attention)
    return AutoModelForCausalLM.from_pretrained(hf.weights, config=config, dtype=torch.float32,
                                                attn_implementation=attention,
                                                local_files_only=offline() is not None)


def generation_ids(tok: Any) -> dict[str, Any]:
    """What `generate()` reads of a causal LM's generation config: the tokenizer's special ids
    and the KV cache on. Training puts the tokenizer's EOS between documents
    (harness/data/c4.py), so generation stops there; with no pad token, EOS pads, as in
    training. The model's config takes the same but `pad_token_id`: the embedding's, set at
    build."""
    eos = tok.eos_token_id
    pad = eos if tok.pad_token_id is None else tok.pad_token_id
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": eos, "pad_token_id": pad,
            "use_cache": True}


def generation_ready(model: PreTrainedModel, tok: Any) -> None:
    """`generation_ids` in a causal LM's config and generation config; a model that does not
    generate (a GLUE classifier) is left as it is."""
    if not model.can_generate():
        return
    for key, value in generation_ids(tok).items():
        setattr(model.generation_config, key, value)
        if key != "pad_token_id":
            setattr(model.config, key, value)


def describe(model: PreTrainedModel) -> str:
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    return f"{total / 1e6:.2f}M parameters ({(total - embed) / 1e6:.2f}M without input embeddings)"
