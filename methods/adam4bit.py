"""4-bit AdamW (Li et al., 2023, "Memory Efficient Optimizers with 4-bit States", arXiv
2309.01507) as torchao ships it (`torchao.optim.AdamW4bit`): both moments kept as 4-bit codes
with a float32 scale per block, dequantized to float32 for each update and quantized again.
torchao's 8-bit and FP8 states (`states`) are the same optimizer at other widths.

torchao's optimizer is used as it is (its quantized state tensors, its single-tensor step and,
on CUDA, its compiled kernel): it does the work well and is a kept library. The harness adds
two things it cannot do here, in `LowBitAdamW._new_buffer`: which tensors get quantized states
is decided on the whole tensor (torchao decides on the local shard, so under fsdp a shard below
its 4,096-value threshold would keep float states and the arithmetic would change with the
world size), and a tensor kept in float states takes `train.state_dtype` under bf16-true
(torchao: the weight's dtype). torchao's quantization departs from the paper's: blockwise
absmax scales for both moments, where the paper normalises the second moment rank-1
(docs/fidelity.md#4-bit-adamw).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.methods.full import AdamConfig
from harness.modifiers.compensation import STATE_DTYPES

if TYPE_CHECKING:
    from harness.config import RunConfig

# torchao's rule, after bitsandbytes': smaller tensors keep float states (torchao/optim/adam.py)
MIN_QUANTIZED = 4096
DEFAULT_BLOCK = {"int4": 128, "int8": 256, "fp8": 256}  # torchao's classes' defaults


class Adam4bitConfig(AdamConfig):
    states: Literal["int4", "int8", "fp8"] = Field(
        "int4", description="the moments' format: int4 (torchao AdamW4bit, the paper's "
        "4-bit states), int8 (AdamW8bit) or fp8 (AdamWFp8)")
    block_size: int | None = Field(
        None, ge=1, description="values per quantization block (None: torchao's default for "
        "`states`, 128 for int4 as the paper's B128, 256 for int8 and fp8)")
    compile_step: bool = Field(
        True, description="run torchao's step compiled (torch.compile, as torchao does; its "
        "fused kernel on CUDA); false: the same step eagerly (no compile time, on CPU)")

    @property
    def block(self) -> int:
        return self.block_size or DEFAULT_BLOCK[self.states]


def quantized(numel: int, local_numel: int, block: int) -> bool:
    """Whether a tensor's moments are quantized: the whole tensor is large enough (torchao's
    rule) and this rank's part is whole blocks."""
    return numel >= MIN_QUANTIZED and numel % block == 0 and local_numel % block == 0


@cache
def low_bit_class(states: str) -> type[torch.optim.Optimizer]:
    """torchao's low-bit AdamW of `states`, with the harness's two additions (module
    docstring); imported when first trained, so that listing methods does not load torchao."""
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

    base = {"int4": AdamW4bit, "int8": AdamW8bit, "fp8": AdamWFp8}[states]

    class LowBitAdamW(base):  # type: ignore[misc, valid-type]
        def __init__(self, groups: Groups, *, compile_step: bool,
                     state_dtype: torch.dtype | None, **kwargs: Any) -> None:
            super().__init__(groups, **kwargs)
            self.compile_step, self.state_dtype = compile_step, state_dtype

        def _new_buffer(self, p: Tensor, signed: bool) -> Tensor:
            """A moment of this rank's rows, quantized by the whole tensor's size."""
            rows = Rows(p)
            local = rows.local
            if quantized(p.numel(), local.numel(), self.block_size):
                out = self._subclass_zeros(local, signed, self.block_size)
            else:
                out = torch.zeros_like(local, dtype=self.state_dtype or local.dtype)
            return rows.placed(out)

        def step(self, closure: Any = None) -> Any:
            stance = nullcontext() if self.compile_step else \
                torch.compiler.set_stance("force_eager")
            with stance:
                return super().step(closure)

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = f"{base.__name__}Harness"
    return LowBitAdamW


@register("adam4bit")
class Adam4bit(Method):
    summary = "AdamW with 4-bit blockwise moments (torchao AdamW4bit; or its 8-bit, FP8)"
    Config = Adam4bitConfig

    def check(self, run: RunConfig) -> Terms:
        """torchao's step takes FSDP's DTensors (each rank quantizes its rows by whole blocks);
        it rounds a bf16 update to nearest or stochastically, and keeps no Kahan buffer."""
        t = run.train
        refusal = unpaged(run, "quantized moments")
        if t.precision == "bf16-true" and t.update_compensation == "kahan":
            refusal = ("torchao's low-bit AdamW rounds a bfloat16 update to nearest or "
                       "stochastically and keeps no Kahan buffer; use "
                       "train.update_compensation: none or stochastic_rounding")
        return Terms(refusal=refusal, fsdp=None)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c, t = self.config, run.train
        pure = t.precision == "bf16-true"
        return low_bit_class(c.states)(
            groups, lr=t.lr, betas=c.betas, eps=c.eps, block_size=c.block,
            compile_step=c.compile_step, bf16_stochastic_round=pure
            and t.update_compensation == "stochastic_rounding",
            state_dtype=STATE_DTYPES[t.state_dtype] if pure else None)
