"""Model sources for tests/train/test_meta_init.py and test_meta_sources.py: tiny HF configs and
weights, GLUE runs, pretrained bodies saved as transformers saves them, weights rewritten as
.bin or shards, and a hub cache's layout."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import micro_run

from harness.data.c4 import SAMPLE


def seeded(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def qwen2(folder: Path, family: str = "qwen2") -> str:
    """A tiny config (no weights) of `family`; Qwen2's head tied to its embedding."""
    from transformers import MistralConfig, Qwen2Config

    kind = Qwen2Config if family == "qwen2" else MistralConfig
    kind(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=8192,
         tie_word_embeddings=family == "qwen2").save_pretrained(folder / family)
    return str(folder / family)


def with_weights(folder: Path, family: str) -> str:
    """`qwen2`'s config with weights drawn by another seed, as save_pretrained writes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(qwen2(folder, family))
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / f"{family}_weights")
    return str(folder / f"{family}_weights")


def glue(model: str, **train: Any) -> dict[str, Any]:
    """A GLUE run (the embedded task: two labels) fine-tuning `model`."""
    return {**micro_run(**train), "model": model,
            "task": {"kind": "glue", "glue_task": "sample", "tokenizer": "sample", "seq_len": 48}}


def encoder_folder(folder: Path, family: str) -> str:
    """A pretrained body as transformers saves one, drawn by another seed, with the sample
    tokenizer: a RoBERTa encoder (its files' keys without the `roberta.` prefix the classifier
    adds), or a LLaMA causal LM (its lm_head a weight the classifier does not take)."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        RobertaConfig,
        RobertaModel,
    )

    tok = AutoTokenizer.from_pretrained(str(SAMPLE / "tokenizer"))
    sizes = {"vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "pad_token_id": tok.pad_token_id}
    torch.manual_seed(5)
    if family == "roberta":
        body = RobertaModel(RobertaConfig(intermediate_size=128, max_position_embeddings=80,
                                          **sizes))
    else:
        body = LlamaForCausalLM(LlamaConfig(intermediate_size=160, **sizes))
    body.save_pretrained(folder / family)
    tok.save_pretrained(folder / family)
    return str(folder / family)


def hub_repo(cache: Path, repo: str, source: Path) -> None:
    """`source`'s files as the hub's cache lays out a downloaded snapshot of `repo`."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    shutil.copytree(source, folder / "snapshots" / ("0" * 40))


def as_bin(folder: Path, shards: int, form: str = "bin") -> Path:
    """`folder`'s safetensors weights rewritten as PyTorch pickles (pytorch_model.bin), or as
    `shards` files of `form` (bin, safetensors) and the index that names each weight's."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    stem = "pytorch_model" if form == "bin" else "model"
    names, where = sorted(state), {}
    for k in range(shards):
        file = f"{stem}-{k + 1:05d}-of-{shards:05d}.{form}"
        part = {n: state[n] for n in names[k::shards]}
        if form == "bin":
            torch.save(part, folder / file)
        else:
            save_file(part, folder / file, metadata={"format": "pt"})
        where |= dict.fromkeys(part, file)
    size = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": size}, "weight_map": where}
    (folder / f"{stem}.{form}.index.json").write_text(json.dumps(index))
    return folder
