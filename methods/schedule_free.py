"""Schedule-Free AdamW (Defazio et al., 2024, "The Road Less Scheduled", arXiv 2405.15682): no
LR schedule; the optimizer keeps z (the base sequence of AdamW steps, in its state) and the
weights hold y = (1 - β1) z + β1 x, where gradients are taken; x, an average of the z's weighted
by lr^weight_lr_power (and step^r), is the model evaluated and exported.

The authors' package does it all (`schedulefree.AdamWScheduleFree`, its foreach step): used as
it is, because its step and its `train()`/`eval()` switch between y and x are the authors' own,
elementwise (so DDP and FSDP's row shards take it unchanged) and keep nothing but z and the
second moment. The trainer switches to x around each evaluation and each checkpoint, so the
checkpoint (and the model exported from it) holds x, and back to y after
(harness/train/averaged.py, docs/training.md). Its warmup is the optimizer's (linear over
`train.warmup_steps`), so the run's schedule is constant (`Terms.lr_factor`). The tests check
it against pytorch-optimizer's ScheduleFreeAdamW and the package's reference variant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import schedulefree
import torch
from pydantic import Field

from harness.config import Strict
from harness.config.tuning import tunable
from harness.methods.base import Groups, Method, Terms, register, unpaged

if TYPE_CHECKING:
    from harness.config import RunConfig

BF16_TRUE = ("its train/eval switch moves bfloat16 weights between y and x in place, rounding "
             "them at every evaluation and checkpoint, and schedulefree keeps z and the second "
             "moment in the weights' dtype with no update compensation; use bf16-mixed")


class ScheduleFreeConfig(Strict):
    betas: tuple[float, float] = tunable(
        (0.9, 0.999), values=[(0.9, 0.999), (0.95, 0.999), (0.98, 0.999)],
        description="β1 (where y sits between z and x: the momentum) and β2 (the second "
        "moment): schedulefree adamw_schedulefree.py defaults, the paper's Algorithm 1",
        source="β1, which the Schedule-Free paper finds wants raising at long runs")
    eps: float = Field(1e-8, gt=0, description="added to the second moment's root "
                       "(schedulefree's default)")
    r: float = Field(0.0, ge=0, description="x averages the z's weighted by step^r: 0, the "
                     "uniform average of the paper's theory (schedulefree's default)")
    weight_lr_power: float = Field(
        2.0, ge=0, description="x's weights grow as lr^weight_lr_power during the warmup, so "
        "warmup steps count less (schedulefree's default 2.0, the paper's warmup weighting)")


def constant(step: int) -> float:
    """The run's LR multiplier: 1 at every step; the warmup is the optimizer's own."""
    return 1.0


@register("schedule_free")
class ScheduleFree(Method):
    summary = "Schedule-Free AdamW (schedulefree): no LR schedule; eval and export at x"
    Config = ScheduleFreeConfig

    def check(self, run: RunConfig) -> Terms:
        refusal = BF16_TRUE if run.train.precision == "bf16-true" else unpaged(
            run, "z and second moments")
        # fsdp: every operation is elementwise, on each rank's rows of the weight
        return Terms(refusal=refusal, fsdp=None, lr_factor=constant)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """The package's optimizer in train mode (the weights are y from its first step)."""
        c = self.config
        opt = schedulefree.AdamWScheduleFree(
            groups, lr=run.train.lr, betas=c.betas, eps=c.eps,
            warmup_steps=run.train.warmup_steps, r=c.r, weight_lr_power=c.weight_lr_power)
        opt.train()
        return opt
