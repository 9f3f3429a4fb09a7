"""LLaMA presets: GaLore's pretraining configs plus tiny ones that train on a laptop CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from harness.config import Common, ModelFrom
from harness.errors import UserError, suggest

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    max_seq_len: int = 1024


PRESETS: dict[str, Preset] = {
    "llama_micro": Preset(64, 176, 2, 2),
    "llama_tiny": Preset(256, 688, 4, 4),
    "llama_60m": Preset(512, 1376, 8, 8),
    "llama_130m": Preset(768, 2048, 12, 12),
    "llama_350m": Preset(1024, 2736, 24, 16),
    "llama_1b": Preset(2048, 5461, 24, 32),
    "llama_7b": Preset(4096, 11008, 32, 32, max_seq_len=2048),
}


def check_preset(name: str, path: str) -> Preset:
    if name not in PRESETS:
        raise suggest(name, list(PRESETS), "model preset", path)
    return PRESETS[name]


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
                 attention: str = "sdpa", **extra: Any) -> Any:
    """GaLore's configs (RMSNorm eps 1e-6, SiLU, untied head)."""
    from transformers import LlamaConfig

    p = check_preset(name, "model")
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


def build_model(name: str, vocab_size: int, seq_len: int, pad_id: int | None) -> LlamaForCausalLM:
    """Random-init LLaMA for pretraining."""
    from transformers import LlamaForCausalLM

    config = llama_config(name, vocab_size, seq_len, pad_id, attention=register_causal_sdpa())
    return LlamaForCausalLM(config)


def describe(model: LlamaForCausalLM) -> str:
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    return f"{total / 1e6:.2f}M parameters ({(total - embed) / 1e6:.2f}M without input embeddings)"


def param_shapes(name: str, vocab_size: int, seq_len: int) -> dict[str, torch.Size]:
    """Every parameter's shape, from a model built on the meta device: no memory, no data."""
    with torch.device("meta"):
        model = build_model(name, vocab_size, seq_len, None)
    return {n: p.shape for n, p in model.named_parameters()}


def check_model(run: Common) -> None:
    """Pretraining starts from a preset; fine-tuning also from a hub model, a local one or a
    harness checkpoint (resolved when the trial starts: the pretraining may still be running)."""
    if run.task.kind == "pretrain":
        if isinstance(run.model, ModelFrom):
            raise UserError("model: {from: ...} fine-tunes a checkpoint; it needs task.kind glue")
        check_preset(run.model, "model")
