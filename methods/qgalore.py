"""Q-GaLore (Zhang et al., 2024): GaLore on INT8 weights, INT4 projections, lazy SVDs.

The targeted linears become quant.Int8Linear (INT8 codes, no float weight) and are updated
inside backward (methods/qgalore_optim.py); every other parameter trains with the inner
optimizer at full rank. `simulate` keeps float weights, fake-quantized to INT8 (nearest) in
forward with a straight-through gradient, and runs GaLore's ordinary optimizer with the same INT4
bases and lazy schedule: the form that data parallelism can use. Its `simulate_mode`:
`fake_quant` (ours, the default) keeps the float weights between steps, so updates below an INT8
step accumulate there; `snap` (the reference's `--simulation`) also rounds every targeted weight
stochastically onto its INT8 grid after each step, so the weights are INT8 values held in floats,
as in the fused form. Settings that select the reference code's behaviour: docs/fidelity.md.

Memory, counted as the real tensors hold it (estimate == measure):
- weights: one byte per INT8 code plus the float32 non-target parameters (simulate: all float);
- extras: INT8 scales and zero points, the packed INT4 bases with their scales and zero points,
  and LazyGap's previous first singular vector (float32); simulate keeps float bases instead;
- gradients: fused, they are freed inside backward, so what is counted is what existed: the
  largest single one (a target's G is out×in float32) without accumulation, and with it every
  accumulation buffer at its peak, an SVD step, where targets accumulate the full G (other steps
  hold the projected r×n or m×r); simulate keeps every `.grad`;
- optimizer state: the low-rank moments of targets and the full-size ones of the others (8-bit
  blockwise with their maps and absmax when the inner optimizer is adam8bit and a tensor has at
  least `min_8bit_size` values, as methods/galore.py counts them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.nn.utils import parametrize

from harness.methods.base import Groups, Terms, register
from harness.methods.galore import GaLore, ProjectionConfig
from harness.methods.qgalore_optim import QGaLoreOptimizer, QGaLoreSimOptimizer
from harness.methods.quant import Int8Linear, dequantize_int8, quantize_int8
from harness.methods.surgery import replace_linears, target_linears
from harness.modifiers.compensation import own_optimizer_kwargs
from harness.modifiers.optimizer import unwrap

if TYPE_CHECKING:
    from harness.config import RunConfig


class QGaLoreConfig(ProjectionConfig):
    """GaLore's projection settings (the gap is the base of the lazy schedule; targets are INT8)."""

    weight_group: int = Field(256, ge=1, description="values per INT8 weight quantization group")
    proj_group: int = Field(256, ge=1, description="values per INT4 projection group")
    queue_size: int = Field(5, ge=1, description="lazy update: cosines averaged before growing")
    threshold: float = Field(
        0.4, ge=0, le=1, description="lazy update: mean cosine to grow (|cosine|: ours)")
    gamma: float = Field(2.0, ge=1, description="lazy update: the gap's growth factor")
    optimizer: Literal["adamw", "adam8bit"] = Field(
        "adam8bit", description="inner optimizer, also used at full rank for the other weights")
    min_8bit_size: int = Field(4096, ge=1, description="adam8bit: smaller states stay 32-bit")
    simulate: bool = Field(
        False, description="float weights fake-quantized in forward; ordinary gradients")
    simulate_mode: Literal["fake_quant", "snap"] = Field(
        "fake_quant", description="simulate: fake_quant keeps float weights between steps; "
        "snap (the reference's) rounds them stochastically to the INT8 grid after each step")
    snap_rounding: Literal["stochastic", "nearest"] = Field(
        "stochastic", description="simulate_mode snap: how weights round onto the grid "
        "(the reference: stochastic with --stochastic_round, else nearest)")
    lazy_schedule: Literal["ours", "reference"] = Field(
        "ours", description="ours: |cosine|, queue restarted after each growth, gap counted "
        "from the last SVD; reference: signed cosine, rolling queue, SVD when step % gap == 0")
    clip_int8: bool = Field(
        True, description="train.grad_clip also clips each INT8 layer's low-rank gradient "
        "(false: the reference, which never clips them)")

    @model_validator(mode="after")
    def _check(self) -> QGaLoreConfig:
        if self.snap_rounding == "nearest" and self.simulate_mode != "snap":
            raise ValueError("snap_rounding 'nearest' needs simulate_mode: snap")
        if self.simulate_mode == "snap" and not self.simulate:
            raise ValueError("simulate_mode 'snap' needs simulate: true (simulate: false "
                             "already keeps INT8 weights)")
        if not self.clip_int8 and self.simulate:
            raise ValueError("clip_int8: false needs simulate: false (the simulated form clips "
                             "every gradient together, as the reference's simulation does)")
        return self


class FakeInt8(nn.Module):
    """A parametrization: forward sees the INT8-rounded weight, backward passes straight
    through to the float weight (the straight-through estimator)."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        q = dequantize_int8(*quantize_int8(w, self.group), self.group).to(w.dtype)
        return w + (q - w).detach()


@register("qgalore")
class QGaLore(GaLore):
    summary = "Q-GaLore: INT8 weights updated in backward, INT4 projections, lazy SVDs"
    Config = QGaLoreConfig

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        c = self.config
        for name, linear in target_linears(model, c.target_modules, anywhere=True):
            if c.simulate:
                parametrize.register_parametrization(linear, "weight", FakeInt8(c.weight_group))
            else:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child,
                        Int8Linear.from_linear(linear, c.weight_group))
        return model

    def _common(self, run: RunConfig) -> dict[str, Any]:
        c = self.config
        return {"lr": run.train.lr, "betas": c.betas, "eps": c.eps, "inner": c.optimizer,
                "min_8bit_size": c.min_8bit_size, **own_optimizer_kwargs(run.train),
                "lazy": {"base_gap": c.update_proj_gap, "queue_size": c.queue_size,
                         "threshold": c.threshold, "gamma": c.gamma,
                         "schedule": c.lazy_schedule}}

    def check(self, run: RunConfig) -> Terms:
        """Refusals of the fused form (INT8 layers updated inside backward, by the optimizer
        itself) and of the simulated one; never sharded."""
        m, fused = run.memory, not self.config.simulate
        refusal = super().check(run).refusal
        if fused and m.optimizer_offload != "none":
            refusal = ("its INT8 weights are updated inside backward on the training device, so "
                       "the optimizer cannot move to the host (simulate: true can)")
        elif fused and run.train.precision == "16-mixed":
            refusal = ("its INT8 updates run inside backward, before an overflow in a later "
                       "gradient could skip the step; use bf16-mixed (or simulate: true with "
                       "16-mixed)")
        elif (not fused and self.config.simulate_mode == "snap" and
              run.train.precision == "bf16-true" and run.train.update_compensation != "none"):
            refusal = ("simulate_mode snap rounds its targeted weights to the INT8 grid after "
                       "every step, which discards what an update compensation keeps; use "
                       "train.update_compensation: none")
        elif not fused and m.layerwise:
            refusal = ("the layer-wise form of Q-GaLore is simulate: false, whose INT8 layers "
                       "already update inside backward")
        fsdp = ("its INT8 weights are buffers updated inside backward, not parameters FSDP "
                "shards and reduces; use train.parallel: ddp")
        return Terms(refusal=refusal, fsdp=fsdp, in_backward=fused)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """simulate: GaLore's groups; else one group of every parameter, with the INT8 layers
        (`layers`)."""
        if self.config.simulate:
            return super().groups(model, run)
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        return [{"params": list(model.parameters()), "layers": layers}]

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """simulate: GaLore's optimizer, with the INT4 bases and lazy SVDs; else the INT8
        layers' own, which updates them inside backward (and the rest layer-wise)."""
        c = self.config
        if c.simulate:
            snap = c.weight_group if c.simulate_mode == "snap" else None
            return QGaLoreSimOptimizer(
                groups, proj_group=c.proj_group, proj_type=c.proj_type, scale=c.scale,
                snap=snap, seed=run.seed, stochastic=c.snap_rounding == "stochastic",
                **self._common(run))
        (group,) = groups
        return QGaLoreOptimizer(  # Int8Linear keeps no weight parameter: the rest are others
            group["layers"], group["params"], weight_decay=run.train.weight_decay,
            rank=c.rank, proj_type=c.proj_type, scale=c.scale, proj_group=c.proj_group,
            clip=run.train.grad_clip, clip_int8=c.clip_int8, seed=run.seed, **self._common(run))

    def on_step(self, step: int, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """An event only on steps that ran an SVD; `svd_skipped` counts those GaLore's fixed
        schedule would have run by now and the lazy gap did not."""
        if self.config.simulate:  # it may sit in a host offload wrapper
            optimizer = unwrap(optimizer)[0]
        attempts = optimizer.take_svd_attempts()  # type: ignore[attr-defined]
        if not attempts:
            return None
        return {"qgalore_svd": attempts, **optimizer.svd_stats()}  # type: ignore[attr-defined]

    def export(self, model: nn.Module) -> nn.Module:
        """INT8 weights dequantized into float linears (simulate: the parametrization's
        snapped weight kept as the plain one)."""
        for module in list(model.modules()):
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return replace_linears(model, Int8Linear, Int8Linear.dequantized)
