"""ReLoRA (Lialin et al., 2024): LoRA whose adapters are merged into the base every N steps.

Each merge adds s·B·A to the frozen weight and draws a fresh adapter pair, so a sequence of
low-rank updates builds a high-rank one. Around each merge the adapters' Adam moments are
pruned (or zeroed) and the LR warms up again from ~0 (a jagged cosine), so the fresh pair
starts without the old pair's momentum.

Initialisation: with peft's default (A Kaiming, B = 0) A's gradient s·Bᵀ·δ·xᵀ is zero until B
has moved, after the start and after every merge. The default here is peft's "orthogonal" init:
A and B are drawn from complementary halves of a random orthogonal basis, so B·A = 0 (to
rounding) while both are nonzero. The function is unchanged and both factors get
gradients from the first step, without touching the base weight; the price is that each factor
has rank r/2 at the draw, so r must be even. `init: lora` gives the reference code's
Kaiming/zero pair.

Nothing is kept outside the model and optimizer: merge counts come from the step number, and
the end of the full-rank warm start from the adapters' Adam step count, so resume needs no
state of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from harness.methods.base import MemoryEstimate, Shapes, register
from harness.methods.full import adam_bytes
from harness.methods.lora import (
    ADAPTER,
    Lora,
    LoraParams,
    LoraShapes,
    adapter_params,
    add_adapters,
    lora_layers,
)

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

    from harness.config import RunConfig

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state that the reset prunes; `step` is kept
PEFT_INIT: dict[str, bool | str] = {"orthogonal": "orthogonal", "lora": True}  # init_lora_weights


class ReLoraParams(LoraParams):
    reset_every: int = Field(1000, ge=1, description="steps between merges (and resets)")
    optimizer_reset: Literal["prune", "full"] = Field(
        "prune", description="prune: zero the smallest moments; full: zero all moments"
    )
    prune_ratio: float = Field(
        0.999, ge=0, le=1, description="fraction of each moment tensor zeroed by `prune`"
    )
    restart_warmup_steps: int = Field(
        100, ge=0, description="linear LR warmup after each merge, back to the global cosine"
    )
    warm_start_steps: int = Field(
        0, ge=0, description="first steps in which the target linears also train at full rank"
    )
    init: Literal["orthogonal", "lora"] = Field(
        "orthogonal",
        description="orthogonal: B·A = 0 with both nonzero (both get gradients at once); "
        "lora: A Kaiming, B zero (the reference code)",
    )

    @model_validator(mode="after")
    def _check(self) -> ReLoraParams:
        if self.init == "orthogonal" and self.rank % 2:
            raise ValueError(f"init 'orthogonal' needs an even rank, got {self.rank}")
        if self.restart_warmup_steps > self.reset_every:
            raise ValueError(
                f"restart_warmup_steps {self.restart_warmup_steps} is longer than "
                f"reset_every {self.reset_every}"
            )
        return self


@register("relora")
class ReLora(Lora):
    summary = "ReLoRA: LoRA merged and re-drawn every N steps, pruned moments, jagged cosine LR"
    Config = ReLoraParams

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        model = add_adapters(model, self.config, init=PEFT_INIT[self.config.init])
        # The full-rank warm start trains the target weights too; they stay in the optimizer's
        # groups afterwards (without gradients or state) so a resumed optimizer matches.
        self.base = [layer.get_base_layer().weight for layer in lora_layers(model)]
        self.adapters = adapter_params(model)
        if self.config.warm_start_steps:
            for p in self.base:
                p.requires_grad_(True)
        return model

    def optimizer(self, model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
        optimizer = super().optimizer(model, run)
        optimizer.register_load_state_dict_post_hook(self._after_load)
        return optimizer

    def refusal(self, run: RunConfig) -> str | None:
        if run.memory.layerwise or run.memory.optimizer_offload != "none":
            return (
                "ReLoRA's warm start and resets act on the whole optimizer between steps "
                "(dropping the frozen weights' states, pruning the adapters' torch AdamW "
                "moments in place), so its optimizer cannot be split per parameter "
                "(memory.layerwise) or moved (memory.optimizer_offload)"
            )
        return None

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        """A resume past the warm start freezes the base again (the adapters count the steps)."""
        state = optimizer.state.get(self.adapters[0], {})
        done = int(state["step"]) if "step" in state else 0
        if self.config.warm_start_steps and done >= self.config.warm_start_steps:
            self._freeze_base(optimizer)

    def _freeze_base(self, optimizer: torch.optim.Optimizer) -> None:
        for p in self.base:
            p.requires_grad_(False)
            p.grad = None
            optimizer.state.pop(p, None)

    def on_step(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        cfg, events = self.config, {}
        if cfg.warm_start_steps and step == cfg.warm_start_steps:
            self._freeze_base(optimizer)
            events["warm_start"] = "done"
        if step % cfg.reset_every == 0:
            with torch.no_grad():
                for layer in lora_layers(model):
                    merge_and_redraw(layer, cfg.init)
            zeroed = reset_moments(optimizer, self.adapters, cfg)
            reset = f"prune {cfg.prune_ratio}" if cfg.optimizer_reset == "prune" else "full"
            events.update(
                relora_merge=step // cfg.reset_every, optimizer_reset=reset, moments_zeroed=zeroed
            )
        return events or None

    def lr_factor(self, step: int, run: RunConfig) -> float:
        """The global schedule, but the steps after each merge ramp linearly up to it again."""
        since = step % self.config.reset_every
        warmup = self.config.restart_warmup_steps
        if step < self.config.reset_every or since >= warmup:
            return super().lr_factor(step, run)
        # the ramp ends on the global value of its last step, as in the reference scheduler
        return (since + 1) / warmup * super().lr_factor(step - since + warmup - 1, run)

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """Peak bytes: with a warm start, the full-rank phase where the targets train too."""
        s = LoraShapes(shapes, self.config)
        trainable = s.trainable
        if self.config.warm_start_steps:
            trainable = trainable + [out * inp for out, inp in s.target_weights]
        return adam_bytes(s.float_numel, trainable, run, self.steps)


def merge_and_redraw(layer: LoraLayer, init: str) -> None:
    """W += s·B·A, then a fresh pair written into the same Parameters the optimizer holds."""
    layer.get_base_layer().weight.add_(layer.get_delta_weight(ADAPTER))
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    if init == "orthogonal":
        layer.orthogonal_init(ADAPTER)  # peft assigns new Parameters: copy them back below
    else:
        layer.reset_lora_parameters(ADAPTER, PEFT_INIT[init])
    a.copy_(layer.lora_A[ADAPTER].weight)
    b.copy_(layer.lora_B[ADAPTER].weight)
    layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight = a, b


def reset_moments(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], cfg: ReLoraParams
) -> float:
    """Prune (keep the largest-magnitude entries) or zero the adapters' moments in place.

    Returns the fraction of moment entries that are zero afterwards.
    """
    zeros = total = 0
    for p in params:
        for key in MOMENTS:
            moment = optimizer.state.get(p, {}).get(key)
            if moment is None:
                continue
            keep = moment.numel() - int(cfg.prune_ratio * moment.numel())
            if cfg.optimizer_reset == "full" or keep == 0:
                moment.zero_()
            elif keep < moment.numel():
                flat = moment.view(-1)
                kept = flat.abs().topk(keep).indices
                flat.copy_(torch.zeros_like(flat).index_copy_(0, kept, flat[kept]))
            zeros += int((moment == 0).sum())
            total += moment.numel()
    return zeros / total if total else 0.0
