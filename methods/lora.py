"""LoRA (Hu et al., 2022) through peft: frozen base linears plus trainable low-rank adapters B·A.

For pretraining, the parameters outside the targets (embeddings, norms, lm_head) train at full
rank by default, as in the papers' LoRA baseline. ReLoRA and QLoRA build on the helpers here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field
from torch import nn

from harness.methods.base import Groups, Method, Terms, register
from harness.methods.full import AdamConfig, adamw
from harness.methods.surgery import TARGETS

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

    from harness.config import RunConfig

ADAPTER = "default"  # peft's name for the one adapter


class LoraParams(AdamConfig):
    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="adapter output scale is alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TARGETS),
        min_length=1,
        description="linear layers (by last name component) that get frozen weights and adapters",
    )
    train_non_targets: bool = Field(
        True, description="embeddings, norms and lm_head train at full rank (pretraining)"
    )


def add_adapters(model: nn.Module, config: LoraParams, init: bool | str = True) -> nn.Module:
    """Wrap the targets with peft adapters (`init` as peft's `init_lora_weights`)."""
    from peft import LoraConfig, get_peft_model

    classifier = type(model).__name__.endswith("ForSequenceClassification")
    peft_config = LoraConfig(
        task_type="SEQ_CLS" if classifier else None,  # fine-tuning: the new head trains too
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        init_lora_weights=init,
    )
    model = get_peft_model(model, peft_config)
    if config.train_non_targets:  # peft froze everything but the adapters
        base = {id(p) for layer in lora_layers(model) for p in layer.get_base_layer().parameters()}
        adapters = {id(p) for p in adapter_params(model)}
        for p in model.parameters():
            if id(p) not in base and id(p) not in adapters:
                p.requires_grad_(True)
    return model


def lora_layers(model: nn.Module) -> list[LoraLayer]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def adapter_params(model: nn.Module) -> list[nn.Parameter]:
    """A and B of every adapter, in module order."""
    return [
        p
        for layer in lora_layers(model)
        for p in (layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight)
    ]


@register("lora")
class Lora(Method):
    summary = "LoRA adapters on frozen linears (peft); embeddings, norms and head full-rank"
    tasks = ("finetune",)
    tasks_note = ("LoRA fine-tunes a pretrained model; from scratch, rank-r adapters on random "
                  "frozen weights bound what is learnt (GaLore Table 2, LLaMA-1B: perplexity "
                  "19.21 against full-rank's 15.56)")
    Config = LoraParams

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        return add_adapters(model, self.config)

    def check(self, run: RunConfig) -> Terms:
        return Terms(fsdp=None)  # frozen and trained rows alike sharded; AdamW steps shards

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        return adamw(groups, run, self.config)

    def export(self, model: nn.Module) -> nn.Module:
        """The adapters merged into their linears, W + (alpha / r)·B·A, and peft's wrappers
        removed: the base model."""
        return model.merge_and_unload()
