"""QLoRA (Dettmers et al., 2023): LoRA adapters (peft) on NF4 base linears (bitsandbytes).

The target linears become `bnb.nn.Linear4bit` holding 4-bit NormalFloat weights in blocks of
`block_size`, with double quantization: each block's absmax is itself quantized to 8 bits in
blocks of 256 (a float32 absmax per such block, a 256-entry float32 map and a float32 offset).
The packed weights count as weights; the quantization constants as extras.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import nn

from harness.methods.base import Terms, register
from harness.methods.lora import ADAPTER, Lora, LoraParams, add_adapters, lora_layers
from harness.methods.surgery import plain_linear, target_linears

if TYPE_CHECKING:
    import bitsandbytes as bnb

    from harness.config import RunConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class QLoraParams(LoraParams):
    block_size: Literal[32, 64, 128, 256, 512, 1024, 2048, 4096] = Field(
        64, description="weights per NF4 quantization block"
    )
    compute_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype the NF4 weights are dequantized to for the matmul"
    )
    train_non_targets: bool = Field(
        False, description="embeddings, norms and lm_head train too (QLoRA fine-tuning: frozen)"
    )


@register("qlora")
class QLora(Lora):
    summary = "LoRA adapters (peft) on NF4 double-quantized frozen linears (bitsandbytes)"
    tasks_note = ("QLoRA fine-tunes a pretrained model stored in NF4; from scratch there are no "
                  "weights worth freezing, and its rank-r adapters bound what is learnt, as "
                  "LoRA's do")
    Config = QLoraParams

    def check(self, run: RunConfig) -> Terms:
        return Terms(fsdp=(
            "its NF4 base weights are bitsandbytes Params4bit, flattened packed codes whose "
            "quantization constants live outside the tensor, so FSDP's dim-0 split would "
            "cut codes from their constants; use train.parallel: ddp (or lora under fsdp)"))

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        from peft import prepare_model_for_kbit_training

        for name, linear in target_linears(model, self.config.target_modules):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, self._nf4(linear))
        model.is_loaded_in_4bit = True  # peft then wraps these with its bnb LoRA layers
        # Freezes everything and keeps non-quantized parameters fp32; checkpointing is the
        # harness's `recompute` modifier, but inputs that require grad keep it compatible.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model.enable_input_require_grads()
        return add_adapters(model, self.config)

    def _nf4(self, linear: nn.Linear) -> bnb.nn.Linear4bit:
        import bitsandbytes as bnb

        q = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=DTYPES[self.config.compute_dtype],
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        # bnb 0.50 repacks the weights for a CPU inference kernel on the first eval forward
        # (bf16 absmax, no backward) and never back: keep one layout for eval and training.
        q.support_avx512bf16_for_cpu = False
        q.weight = bnb.nn.Params4bit(
            linear.weight.data,
            requires_grad=False,
            blocksize=self.config.block_size,
            compress_statistics=True,
            quant_type="nf4",
            module=q,
        ).to(linear.weight.device)  # quantizes
        if linear.bias is not None:
            q.bias = linear.bias
        q.register_load_state_dict_pre_hook(_load_quant_state)
        return q

    def export(self, model: nn.Module) -> nn.Module:
        """Each NF4 base dequantized with its adapter merged on top, as a float linear; then
        peft's wrappers removed. peft's own merge would quantize the merged weight to NF4
        again."""
        for layer in lora_layers(model):
            base = layer.get_base_layer()
            merged = dequantized(base.weight) + layer.get_delta_weight(ADAPTER).float()
            layer.base_layer = plain_linear(merged, base.bias)
        plain = model.unload()
        del plain.is_loaded_in_4bit  # set by `prepare` for peft: the model is float now
        return plain


def dequantized(weight: Any) -> torch.Tensor:
    """An NF4 weight in float32 on the host, dequantized by bitsandbytes on a CUDA device where
    there is one, as a CUDA trial's forward did: its CPU kernel (0.50, AVX-512) is wrong for
    rows that are not whole blocks (tests/methods/test_qlora.py). Without one, the host's
    kernel, which a CPU trial's forward used too."""
    from bitsandbytes.functional import dequantize_4bit

    device = torch.device("cuda") if torch.cuda.is_available() else weight.device
    state = copy.deepcopy(weight.quant_state)
    state.to(device)
    return dequantize_4bit(weight.data.to(device), state).float().cpu()


def quant_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a bitsandbytes QuantState, the nested one's included."""
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors


def _load_quant_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """bnb saves the NF4 constants beside the weight, but a strict load refuses them: load here."""
    from bitsandbytes.functional import QuantState

    keys = [k for k in state_dict if k.startswith(f"{prefix}weight.")]
    if keys:
        stats = {k.removeprefix(f"{prefix}weight."): state_dict.pop(k) for k in keys}
        state = QuantState.from_dict(stats, device=module.weight.device)
        module.weight.quant_state = module.quant_state = state
