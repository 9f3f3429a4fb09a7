"""Decoders to pretrain: LLaMA presets (GaLore's configs plus tiny ones that train on a laptop
CPU), or a Hugging Face config or model folder of a LLaMA-layout decoder (LLaMA, Mistral,
Qwen2, …). `Arch` describes either alike, for the cost model and the methods; their shapes
come without building them. A trial builds them with harness/train/build.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from harness.config import Common, ModelFrom, ModelOptions
from harness.config.hub import in_cache, offline
from harness.errors import UserError, brief, suggest


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
ALLOWED = (f"allowed: a preset ({', '.join(PRESETS)}), a folder holding config.json (with "
           "weights: continued pretraining), or a config.json file")
# What the methods (their target linears), the modifiers and the cost model read of a decoder.
LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
         "input_layernorm", "post_attention_layernorm")  # a decoder layer's weights, in order
LAYOUT = ("model.embed_tokens.weight", "model.norm.weight",
          *(f"model.layers.0.{m}.weight" for m in LAYER))
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class Arch:
    """A decoder's dimensions as the cost model and the methods read them, from a preset or
    an HF config: under grouped-query attention k and v are kv_heads · head_dim wide."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None  # None: a preset's, sized to the tokenizer
    tied: bool  # the head is the input embedding: no lm_head.weight
    max_seq_len: int
    window: int | None = None  # sliding-window attention's span; None: plain causal

    def windowed(self, seq_len: int) -> bool:
        """A window shorter than the sequence: sdpa's mask is needed to honour it."""
        return self.window is not None and self.window < seq_len


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face decoder: its config, its parameters' shapes, and where its weights are
    (None: pretraining from scratch)."""

    config: Any
    arch: Arch
    shapes: dict[str, torch.Size]
    weights: str | None


def check_preset(name: str, path: str, options: ModelOptions | None = None) -> Preset:
    """The preset `name` as `options` build it (its MLP width; default: the paper's)."""
    if name not in PRESETS:
        raise suggest(name, list(PRESETS), "model preset", path)
    p, width = PRESETS[name], mlp_width(PRESETS[name].intermediate, options)
    return p if width == p.intermediate else replace(p, intermediate=width)


def mlp_width(paper: int, options: ModelOptions | None) -> int:
    """A preset's MLP width: `paper`'s, set outright, or rounded up to a multiple."""
    if options is not None and options.intermediate_size is not None:
        return options.intermediate_size
    if options is not None and options.mlp_multiple_of is not None:
        return -(-paper // options.mlp_multiple_of) * options.mlp_multiple_of
    return paper


def width_key(options: ModelOptions | None) -> str | None:
    """The options' key that sets an MLP width, None where the width is the model's own."""
    if options is None:
        return None
    return next((k for k in ("mlp_multiple_of", "intermediate_size")
                 if getattr(options, k) is not None), None)


def no_width(name: str, options: ModelOptions | None) -> None:
    """An HF config's MLP width is the config's: width options are for presets."""
    key = width_key(options)
    if key is not None:
        raise UserError(f"model_options.{key}: '{name}' is not a preset; its MLP width is its "
                        "config's: edit the config's intermediate_size instead, or remove the "
                        f"option (allowed with: {', '.join(PRESETS)})")


def architecture(model: str, options: ModelOptions | None = None) -> Arch:
    """The description every reader of a model's shape uses, preset or HF config alike;
    `options` (a run's model_options) set a preset's MLP width."""
    if model in PRESETS:
        p = check_preset(model, "model", options)
        return Arch(p.hidden, p.intermediate, p.layers, p.heads, p.heads, p.hidden // p.heads,
                    None, False, p.max_seq_len)  # fmt: skip
    no_width(model, options)
    return hf_model(model).arch


def fit_vocab(model: str, tokens: int) -> int:
    """The embedding's rows for a tokenizer of `tokens`: a preset's are sized to it, an HF
    config's must hold it (a larger id would index past the embedding)."""
    vocab = architecture(model).vocab
    if vocab is None:
        return tokens
    if tokens > vocab:
        raise UserError(f"model: '{model}' has vocab_size {vocab}, fewer than the tokenizer's "
                        f"{tokens} tokens; use a tokenizer (task.tokenizer) of at most {vocab} "
                        "tokens, or a config whose vocab_size holds it")
    return vocab


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".json")


@lru_cache
def hf_model(name: str) -> HFModel:
    """`name` (a folder, a config.json, or a hub name) as a checked LLaMA-layout causal LM."""
    path = Path(name).expanduser()
    if path.exists() or _looks_like_path(name):
        config, weights = _local_config(name, path), _local_weights(path)
    else:
        config, weights = _hub_config(name), name
    shapes = _meta_shapes(name, config)
    missing = [n for n in LAYOUT if n not in shapes]
    if missing:
        raise UserError(f"model: '{name}' is a {config.model_type} without LLaMA's layout (no "
                        f"{missing[0]}), which the methods and the cost model read; allowed: "
                        "LLaMA-layout decoders (llama, mistral, qwen2, …)")
    return HFModel(config, _arch(config, shapes), shapes, weights)


def _local_config(name: str, path: Path) -> Any:
    from transformers import AutoConfig

    if not path.exists():
        raise UserError(f"model: no such file or folder '{name}'; {ALLOWED}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"model: the folder '{name}' holds no config.json; {ALLOWED}")
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # a malformed file, an unknown model_type: not a config here
        raise UserError(f"model: transformers cannot read '{name}' as a model config "
                        f"({brief(e)}); {ALLOWED}") from None


def _local_weights(path: Path) -> str | None:
    """The folder, when it holds weights to continue from."""
    if path.is_dir() and any(next(path.glob(p), None) for p in WEIGHTS):
        return str(path)
    return None


def _hub_config(name: str) -> Any:
    """A hub model's config (its weights are loaded at build); offline, one line saying so."""
    local = "a local model is a folder holding config.json or a config.json file"
    reason = offline()  # before transformers is imported: offline, a name not cached fails now
    if reason and not in_cache(name, ("config.json",)):
        preset = suggest(name, list(PRESETS), "model preset", "model")
        raise UserError(f"{preset}; '{name}' is not in the local Hugging Face cache and the hub "
                        f"cannot be reached ({reason}); {local}")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=reason is not None)
    except Exception as e:  # hub, network and file errors all mean "not loadable here"
        preset = suggest(name, list(PRESETS), "model preset", "model")
        raise UserError(f"{preset}, nor a model transformers can load from the hub "
                        f"({brief(e)}); {local}") from None


def _meta_shapes(name: str, config: Any) -> dict[str, torch.Size]:
    """Every parameter's shape from the model built on the meta device (tied ones once)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:  # no causal-LM class for this config
        raise UserError(f"model: '{name}' ({config.model_type}) is not a causal LM "
                        f"transformers builds ({brief(e)}); {ALLOWED}") from None
    return {n: p.shape for n, p in model.named_parameters()}


def _arch(config: Any, shapes: dict[str, torch.Size]) -> Arch:
    heads = config.num_attention_heads
    return Arch(
        hidden=config.hidden_size, intermediate=config.intermediate_size,
        layers=config.num_hidden_layers, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size, tied="lm_head.weight" not in shapes,
        max_seq_len=config.max_position_embeddings, window=_window(config),
    )  # fmt: skip


def _window(config: Any) -> int | None:
    """Mistral's `sliding_window`; Qwen2's only with `use_sliding_window` (and, where the
    config lists layer types, some layer of type sliding_attention)."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return getattr(config, "sliding_window", None)


def param_shapes(name: str, vocab_size: int, options: ModelOptions | None = None
                 ) -> dict[str, torch.Size]:
    """Every parameter's shape, in `named_parameters` order: no memory, no data. `vocab_size`,
    the tokenizer's length, and `options`, as `build_model` takes them."""
    if name not in PRESETS:
        no_width(name, options)
        fit_vocab(name, vocab_size)
        return dict(hf_model(name).shapes)
    return preset_shapes(check_preset(name, "model", options), vocab_size)


def preset_shapes(p: Preset, vocab_size: int) -> dict[str, torch.Size]:
    """A preset's LlamaForCausalLM shapes written out, not built: importing transformers'
    modeling costs a sweep, `harness estimate` or `plan` process seconds of CPU, and a
    preset's layout is fixed (tests/test_models.py checks it against the built model)."""
    h, i = p.hidden, p.intermediate
    sizes = [(h, h)] * 4 + [(i, h), (i, h), (h, i), (h,), (h,)]  # q, k, v, o; the MLP; norms
    layer = dict(zip(LAYER, map(torch.Size, sizes), strict=True))
    shapes = {"model.embed_tokens.weight": torch.Size((vocab_size, h))}
    for k in range(p.layers):
        shapes |= {f"model.layers.{k}.{m}.weight": size for m, size in layer.items()}
    return shapes | {"model.norm.weight": torch.Size((h,)),
                     "lm_head.weight": torch.Size((vocab_size, h))}


def head_shape(shapes: dict[str, Any]) -> Any:
    """The output head's weight: lm_head's, or the input embedding's when they are tied."""
    return shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])


def check_model(run: Common) -> None:
    """Pretraining starts from a preset or an HF config or model (checked here: it must load
    and have LLaMA's layout); fine-tuning also from a hub model, a local one or a harness
    checkpoint (resolved when the trial starts: the pretraining may still be running).
    model_options: a width for a pretrained preset only, liger kernels on CUDA only."""
    check_options(run)
    if run.task.kind == "pretrain":
        if isinstance(run.model, ModelFrom):
            raise UserError("model: {from: ...} fine-tunes a checkpoint; it needs task.kind glue")
        architecture(run.model, run.model_options)


def check_options(run: Common) -> None:
    """What the kernel and width options refuse before the trial starts: a width the model
    does not take (fine-tuning builds the checkpoint's or the encoder's own), a kernel option
    fine-tuning does not apply, liger on the CPU."""
    key = width_key(run.model_options)
    chosen = {f"model_options.{key}": key is not None, "train.tf32": run.train.tf32,
              "model_options.kernels liger": run.model_options.kernels == "liger"}
    for name, on in chosen.items():
        if on and run.task.kind != "pretrain":
            raise UserError(f"{name}: applies to pretraining only (task.kind pretrain); "
                            "fine-tuning builds its model as it is: remove it")
    if run.model_options.kernels == "liger" and run.device == "cpu":
        raise UserError("model_options.kernels: liger runs Triton kernels on CUDA, and this run's "
                        "device is cpu; allowed on the CPU: torch")
