"""APOLLO (Zhu et al., 2024): AdamW-like updates at nearly SGD's memory. Adam runs on a rank-r
random (or SVD) projection of each targeted gradient only to measure per-channel scaling
factors; the full gradient, scaled by them, is the update (methods/apollo_optim.py).

Every weight trains. The low-rank moments and the limiter's last norm are optimizer state; a
random projection is regenerated from its seed, so it costs no bytes, while an SVD basis is
stored (extra bytes, as GaLore's). APOLLO-Mini (rank 1, one factor per tensor) is the same
method with other settings, registered from methods/apollo_mini.py.

`int8_weights` is the paper's 7B recipe: the scaled targets become quant.Int8Linear (INT8
codes, no float weight, as Q-GaLore's) updated inside backward by stochastic rounding
(methods/apollo_int8_optim.py); the other parameters train with AdamW layer-wise. Its memory
is counted as Q-GaLore's: one byte a code plus each group's scale and zero point, and the
gradients that exist at once (the largest one, or with accumulation every target's full G).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from harness.config.tuning import tunable
from harness.methods.apollo_int8_optim import APOLLOInt8Optimizer
from harness.methods.apollo_optim import APOLLOOptimizer
from harness.methods.base import Groups, Terms, register
from harness.methods.full import AdamConfig
from harness.methods.galore import GaLore
from harness.methods.projection import side_of
from harness.methods.quant import Int8Linear
from harness.methods.surgery import TARGETS, replace_linears, target_matrix
from harness.modifiers.compensation import own_optimizer_kwargs
from harness.modifiers.optimizer import unwrap

if TYPE_CHECKING:
    from harness.config import RunConfig

class APOLLOCommon(AdamConfig):
    """What APOLLO and APOLLO-Mini share."""

    betas: tuple[float, float] = Field((0.9, 0.999), description="moment decay rates")
    update_proj_gap: int = tunable(
        200, values=[50, 100, 200, 500], ge=1, description="steps between projections (T)",
        source="around APOLLO's T 200, arXiv 2412.05270, as GaLore's")
    proj: Literal["random", "svd"] = Field(
        "random", description="random: N(0, 1/r) from a seed, never stored; svd: GaLore's basis")
    limiter: bool = Field(True, description="Fira's norm-growth limiter on the scaled gradient")
    gamma: float = Field(1.01, gt=1, description="limiter: the update norm's largest growth")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TARGETS), min_length=1,
        description="a 2-D weight is scaled when one of these is a component of its name")
    optimizer: Literal["adamw", "adam8bit"] = Field(
        "adamw", description="Adam's moments: 32-bit, or 8-bit blockwise (also off-target)")
    min_8bit_size: int = Field(4096, ge=1, description="adam8bit: smaller states stay 32-bit")
    int8_weights: bool = Field(
        False, description="scaled targets are INT8 codes updated in backward by stochastic "
        "rounding (the paper's 7B recipe with apollo_mini; the rest AdamW, layer-wise)")
    weight_group: int = Field(256, ge=1, description="int8_weights: values per quantization group")
    decay_vectors: bool = Field(
        False, description="train.weight_decay on norms and biases too (the reference's "
        "main_pretrain.py: its non-target group takes the optimizer's decay)")

    @model_validator(mode="after")
    def _check_decay(self) -> APOLLOCommon:
        if self.decay_vectors and self.int8_weights:
            raise ValueError("decay_vectors applies to the float form; with int8_weights the "
                             "reference (q_apollo.py) decays no non-target parameter")
        return self

    def projection(self) -> tuple[int, str]:
        """The projection's rank and the scaling's granularity."""
        raise NotImplementedError

    def targeted(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the parameter `name` is a target linear's weight (GaLore's rule)."""
        return target_matrix(name, shape, self.target_modules)

    def projects(self, name: str, shape: tuple[int, ...]) -> bool:
        """A target matrix below full rank; at a rank ≥ min(m, n) AdamW updates it."""
        return self.targeted(name, shape) and side_of(shape, "std", self.projection()[0]) != "none"


class APOLLOConfig(APOLLOCommon):
    rank: int = Field(256, ge=1, description="r: the auxiliary projection's rank")
    scale: float = tunable(1.0, values=[0.25, 0.5, 1.0, 2.0, 4.0], gt=0,
                           description="the update is multiplied by √scale (α²)",
                           source="around APOLLO's α² 1 at rank 256, arXiv 2412.05270")
    scale_type: Literal["channel", "tensor"] = Field(
        "channel", description="one scaling factor per channel, or per matrix")

    def projection(self) -> tuple[int, str]:
        return self.rank, self.scale_type


@register("apollo")
class APOLLO(GaLore):
    summary = "APOLLO: the gradient scaled per channel by Adam run on a rank-r random projection"
    Config = APOLLOConfig

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seeds: dict[Int8Linear, int] = {}  # int8_weights: each layer's projection seed

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        """int8_weights: each scaled linear becomes INT8 (nearest rounding), keeping the seed
        the float method would give it."""
        if not self.config.int8_weights:
            return model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for i, (name, p) in enumerate(named, 1):
            if self.config.projects(name, tuple(p.shape)):
                module = name.rpartition(".")[0]
                parent, _, child = module.rpartition(".")
                layer = Int8Linear.from_linear(model.get_submodule(module),
                                               self.config.weight_group)
                setattr(model.get_submodule(parent), child, layer)
                self.seeds[layer] = i
        return model

    def check(self, run: RunConfig) -> Terms:
        """APOLLO shards (methods/apollo_optim.py): the random projection is drawn whole from
        its seed on every rank; a right side projects this rank's rows, a left side
        all-reduces its r×n product; norms over a shard's rows sum their squares over ranks.
        int8_weights updates its INT8 layers inside backward itself."""
        c, refusal = self.config, super().check(run).refusal
        if c.int8_weights and run.memory.optimizer_offload != "none":
            refusal = ("with int8_weights its INT8 layers are updated inside backward on the "
                       "training device, so the optimizer cannot move to the host")
        elif c.int8_weights and run.train.precision == "16-mixed":
            refusal = ("with int8_weights its INT8 updates run inside backward, before an "
                       "overflow in a later gradient could skip the step; use bf16-mixed")
        fsdp = None
        if c.int8_weights:
            fsdp = ("int8_weights keeps INT8 codes as buffers updated inside backward, not "
                    "parameters FSDP shards and reduces; use train.parallel: ddp")
        elif c.proj == "svd":
            fsdp = ("proj svd needs each gradient gathered for its SVD, not done for APOLLO "
                    "under fsdp yet; use proj: random (the paper's), or train.parallel: ddp")
        elif c.optimizer == "adam8bit":
            fsdp = ("optimizer adam8bit quantizes blocks of the flattened moments, which "
                    "FSDP's row shards would cut; use optimizer: adamw, or train.parallel: ddp")
        return Terms(refusal=refusal, fsdp=fsdp, in_backward=c.int8_weights)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """One group per scaled matrix, with its projection seed (its 1-based place among
        the trained parameters, as the reference numbers them), so a layer-wise split keeps
        each seed; then the other matrices, then vectors (decayed with `decay_vectors`).
        int8_weights: one group of every parameter, with the INT8 layers (`layers`)."""
        if self.config.int8_weights:  # Int8Linear keeps no weight parameter: the rest are others
            layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
            return [{"params": list(model.parameters()), "layers": layers}]
        wd, rank = run.train.weight_decay, self.config.projection()[0]
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups: Groups = [{"params": [p], "rank": rank, "seed": i, "weight_decay": wd}
                          for i, (n, p) in enumerate(named, 1)
                          if self.config.projects(n, tuple(p.shape))]
        ids = {id(g["params"][0]) for g in groups}
        rest = [p for _, p in named if id(p) not in ids]
        vector_wd = wd if self.config.decay_vectors else 0.0
        return [*groups, {"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": vector_wd}]

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c, (rank, scale_type) = self.config, self.config.projection()
        if not c.int8_weights:
            return APOLLOOptimizer(
                groups, lr=run.train.lr, betas=c.betas, eps=c.eps, inner=c.optimizer,
                update_proj_gap=c.update_proj_gap, scale=c.scale, proj=c.proj,
                scale_type=scale_type, limiter=c.limiter, gamma=c.gamma,
                min_8bit_size=c.min_8bit_size,
                **own_optimizer_kwargs(run.train, chunked=True))
        (group,) = groups
        return APOLLOInt8Optimizer(
            group["layers"], [self.seeds[m] for m in group["layers"]], group["params"],
            lr=run.train.lr, betas=c.betas, eps=c.eps, weight_decay=run.train.weight_decay,
            inner=c.optimizer, min_8bit_size=c.min_8bit_size, rank=rank,
            update_proj_gap=c.update_proj_gap, scale=c.scale, proj=c.proj,
            scale_type=scale_type, limiter=c.limiter, gamma=c.gamma, clip=run.train.grad_clip,
            seed=run.seed, **own_optimizer_kwargs(run.train))

    def on_step(self, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """An event only on steps that made new projections."""
        scalings = [o.scaling for o in unwrap(optimizer)]  # type: ignore[attr-defined]
        if isinstance(optimizer, APOLLOInt8Optimizer):
            scalings.append(optimizer.scaling)
        made = sum(s.take_refreshes() for s in scalings)
        if not made:
            return None
        return {"apollo_projections": made,
                "svd_failures": sum(s.svd_failures for s in scalings)}

    def export(self, model: nn.Module) -> nn.Module:
        """int8_weights: each INT8 linear dequantized into a float one."""
        return replace_linears(model, Int8Linear, Int8Linear.dequantized)
