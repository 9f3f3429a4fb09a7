"""`model_options`: how the harness builds the model named by `model` (a section of its own:
`model` stays a name or a folder, as every reader of it expects)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from harness.config.strict import Strict


class ModelOptions(Strict):
    """How the harness builds the model named by `model`: its MLP width (presets) and the
    kernels its layers run."""

    mlp_multiple_of: int | None = Field(
        None, ge=1, description="a preset's MLP width rounded up to a multiple of this (64: "
        "LLaMA-1B's 5461 becomes 5504, a shape the GPU's matmuls run faster); default: the "
        "paper's width"
    )
    intermediate_size: int | None = Field(
        None, ge=1, description="a preset's MLP width set outright"
    )
    kernels: Literal["torch", "liger"] = Field(
        "torch", description="liger: liger-kernel's fused RMSNorm, SwiGLU, RoPE and linear "
        "cross-entropy (CUDA with Triton; pip install '.[kernels]')"
    )

    @model_validator(mode="after")
    def _one_width(self) -> ModelOptions:
        if self.mlp_multiple_of is not None and self.intermediate_size is not None:
            raise ValueError("set mlp_multiple_of or intermediate_size, not both")
        return self
