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
has rank r/2 at the draw, so r must be even. `init: lora` gives peft's Kaiming/zero pair, the
reference code's pair after a merge (it starts from A = B = 0, so nothing is learnt before the
first merge: Guitaricet/relora#18).

Warm start (`warm_start_steps`): `reference` (default) reproduces the reference's two runs in
one: full-rank training alone (adapters frozen, B·A = 0, no merges), then a fresh optimizer
for the adapters and the reference's `cosine_restarts` schedule restarted with its own warmup;
`joint` trains the targets together with the adapters, merging all along, on one schedule.
Differences from the reference, their reasons and tests: docs/fidelity.md#relora.

Nothing is kept outside the model and optimizer: merge counts come from the step number, and
whether the warm start is over from the optimizer (the targets hold Adam state only inside
it), so resume needs no state of its own.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from harness.config.steps import lr_factor
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Terms, decay_groups, register
from harness.methods.lora import (
    ADAPTER,
    Lora,
    LoraParams,
    adapter_params,
    add_adapters,
    lora_layers,
)

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

    from harness.config import RunConfig, TrainConfig

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state that the reset prunes; `step` is kept
PEFT_INIT: dict[str, bool | str] = {"orthogonal": "orthogonal", "lora": True}  # init_lora_weights


class ReLoraParams(LoraParams):
    reset_every: int = Field(1000, ge=1, description="steps between merges (and resets)")
    optimizer_reset: Literal["prune", "full"] = Field(
        "prune", description="prune: zero `prune_ratio` of each moment tensor; full: zero all"
    )
    prune: Literal["magnitude", "random"] = Field(
        "magnitude",
        description="magnitude: zero entries at or below the prune_ratio quantile of |moment| "
        "(reference README); random: keep each entry with probability 1 - prune_ratio "
        "(reference code's default, at 0.999)",
    )
    prune_ratio: float = Field(
        0.999, ge=0, le=1, description="fraction of each moment tensor zeroed by `prune`"
    )
    restart_warmup_steps: int = Field(
        100, ge=0, description="linear LR warmup after each merge, back to the global cosine"
    )
    warm_start_steps: int = Field(
        0, ge=0, description="first steps that train the target linears at full rank"
    )
    warm_start: Literal["reference", "joint"] = Field(
        "reference",
        description="reference: full-rank only, then a new optimizer and a restarted schedule; "
        "joint: the adapters train and merge during the warm start too, one schedule",
    )
    warm_start_warmup_steps: int | None = Field(
        None, ge=0, description="warm_start reference: the restarted schedule's linear warmup "
        "(the reference's second run's --warmup_steps); null: train.warmup_steps",
    )
    init: Literal["orthogonal", "lora"] = Field(
        "orthogonal",
        description="orthogonal: B·A = 0 with both nonzero (both get gradients at once); "
        "lora: A Kaiming, B zero (peft's; the reference's after a merge)",
    )
    decay_vectors: bool = Field(
        False, description="train.weight_decay on norms and biases too (the reference's: it "
        "decays every trainable parameter)")

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

    @property
    def two_runs(self) -> bool:
        """The reference's warm start: a full-rank phase, then a ReLoRA phase of its own."""
        return bool(self.warm_start_steps) and self.warm_start == "reference"


@register("relora")
class ReLora(Lora):
    summary = "ReLoRA: LoRA merged and re-drawn every N steps, pruned moments, jagged cosine LR"
    tasks = ("pretrain", "finetune")  # its merges make the updates high-rank: a pretraining
    # method (Lialin et al.), unlike the LoRA it builds on
    tasks_note = ""
    Config = ReLoraParams

    def check(self, run: RunConfig) -> Terms:
        """ReLoRA shards: a merge adds this rank's rows of s·B·A (B's rows times the whole A,
        gathered: r×in), a new pair is drawn whole as one process draws it and each rank keeps
        its rows, and a prune's threshold is taken over the whole (gathered) moment."""
        return Terms(refusal=self._refusal(run), fsdp=None, warning=self._warning(run),
                     lr_factor=partial(self._lr_factor, run=run))

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        model = add_adapters(model, self.config, init=PEFT_INIT[self.config.init])
        # The full-rank warm start trains the target weights too; they stay in the optimizer's
        # groups afterwards (without gradients or state) so a resumed optimizer matches.
        self._find(model)
        if self.config.warm_start_steps:
            for p in self.base:
                p.requires_grad_(True)
        return model

    def _find(self, model: nn.Module) -> None:
        """The target weights and the adapters, as the model holds them now: under fsdp the
        sharded Parameters that replaced the prepared ones."""
        self.base = [layer.get_base_layer().weight for layer in lora_layers(model)]
        self.adapters = adapter_params(model)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        self._find(model)
        groups = decay_groups(model, run.train.weight_decay, self.config.decay_vectors)
        if self.config.two_runs:  # the adapters are in the groups, but frozen until the
            for p in self.adapters:  # full-rank phase ends
                p.requires_grad_(False)
        return groups

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        optimizer = super().optimizer(groups, run)
        optimizer.register_load_state_dict_post_hook(self._after_load)
        return optimizer

    def _refusal(self, run: RunConfig) -> str | None:
        if run.memory.layerwise or run.memory.optimizer_offload != "none":
            return (
                "ReLoRA's warm start and resets act on the whole optimizer between steps "
                "(dropping the frozen weights' states, pruning the adapters' torch AdamW "
                "moments in place), so its optimizer cannot be split per parameter "
                "(memory.layerwise) or moved (memory.optimizer_offload)"
            )
        return self._restart_refusal(run.train) if self.config.two_runs else None

    def _restart_refusal(self, t: TrainConfig) -> str | None:
        """The reference's own assertions on its second run's schedule (training_utils.py)."""
        cfg, steps = self.config, t.steps
        if t.schedule != "cosine" or steps is None:
            return ("warm_start reference restarts the reference's cosine_restarts schedule: "
                    "it needs train.schedule cosine and train.steps (or use warm_start: joint)")
        rest, warmup = steps - cfg.warm_start_steps, self._rewarm(t)
        if rest <= 0:
            return f"warm_start_steps {cfg.warm_start_steps} must be below train.steps {steps}"
        if warmup > cfg.reset_every:
            return (f"warm_start reference: the restarted warmup ({warmup} steps, "
                    f"warm_start_warmup_steps or train.warmup_steps) must fit in the first "
                    f"cycle (reset_every {cfg.reset_every}), as the reference asserts")
        if rest % cfg.reset_every:
            return (f"warm_start reference: train.steps {steps} - warm_start_steps "
                    f"{cfg.warm_start_steps} = {rest} must be a whole number of reset_every "
                    f"{cfg.reset_every} cycles, as the reference asserts; use e.g. reset_every "
                    f"{self._cycle(rest, warmup)}")
        if cfg.reset_every == 1:
            return "warm_start reference: reset_every 1 never merges on the reference's timing"
        return None

    def _warning(self, run: RunConfig) -> str | None:
        """One line when merges fall inside the global warmup or the last cycle is cut short:
        the run is valid here, but the reference's scheduler refuses such a setting."""
        cfg, t = self.config, run.train
        if cfg.two_runs or t.steps is None:  # two runs: the refusal checked the restart
            return None
        said = []
        inside = max(0, t.warmup_steps - 1) // cfg.reset_every
        if inside:
            said.append(f"{inside} merge(s) fall inside train.warmup_steps {t.warmup_steps}")
        if t.steps % cfg.reset_every:
            said.append(f"train.steps {t.steps} is not a whole number of cycles "
                        f"(the last has {t.steps % cfg.reset_every} steps)")
        if not said:
            return None
        return (f"method.reset_every {cfg.reset_every}: " + " and ".join(said)
                + "; the reference requires warmup_steps <= reset_every and whole cycles: "
                f"use e.g. reset_every {self._cycle(t.steps, t.warmup_steps)}")

    def _cycle(self, steps: int, warmup: int) -> int:
        """The reset_every to suggest: the divisor of `steps` nearest the one set that holds
        the warmup and the restart ramp."""
        low = max(1, warmup, self.config.restart_warmup_steps)
        fits = [d for d in range(low, steps + 1) if steps % d == 0] or [steps]
        return min(fits, key=lambda d: abs(d - self.config.reset_every))

    def _rewarm(self, t: TrainConfig) -> int:
        own = self.config.warm_start_warmup_steps
        return t.warmup_steps if own is None else own

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        """A resume past the warm start freezes the base again: the targets hold Adam state
        only inside it."""
        if self.config.warm_start_steps and not any(p in optimizer.state for p in self.base):
            self._end_warm_start(optimizer, fresh=False)

    def _end_warm_start(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        """Freeze the targets; with two runs, unfreeze the adapters and (`fresh`, at the switch
        itself) empty the optimizer: the reference's new AdamW, from step 0."""
        for p in self.base:
            p.requires_grad_(False)
            p.grad = None
            optimizer.state.pop(p, None)
        if self.config.two_runs:
            for p in self.adapters:
                p.requires_grad_(True)
            if fresh:
                optimizer.state.clear()

    def _merge_number(self, step: int) -> int:
        """Which merge follows `step` (0: none). Two runs: the reference's timing, counted from
        the switch: after steps k = R+1, 2R+1, ... of the ReLoRA phase (each the step its
        schedule runs at LR 0). Else after steps R, 2R, ..."""
        cfg = self.config
        if not cfg.two_runs:
            return 0 if step % cfg.reset_every else step // cfg.reset_every
        k = step - cfg.warm_start_steps
        return k // cfg.reset_every if k > cfg.reset_every and k % cfg.reset_every == 1 else 0

    def on_step(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        cfg, events = self.config, {}
        if cfg.warm_start_steps and step == cfg.warm_start_steps:
            self._end_warm_start(optimizer, fresh=True)
            events["warm_start"] = "done"
        merge = self._merge_number(step)
        if merge:
            with torch.no_grad():
                for layer in lora_layers(model):
                    merge_and_redraw(layer, cfg.init)
            zeroed = reset_moments(optimizer, self.adapters, cfg)
            kind = "random prune" if cfg.prune == "random" else "prune"
            reset = "full" if cfg.optimizer_reset == "full" else f"{kind} {cfg.prune_ratio}"
            events.update(relora_merge=merge, optimizer_reset=reset, moments_zeroed=zeroed)
        return events or None

    def _lr_factor(self, step: int, run: RunConfig) -> float:
        """The global schedule, but the steps after each merge ramp linearly up to it again.
        Two runs: the global schedule in the warm start, then the reference's restarted one."""
        cfg = self.config
        if cfg.two_runs:
            if step < cfg.warm_start_steps:
                return lr_factor(step, run.train)
            t = run.train
            return cosine_restarts(
                step - cfg.warm_start_steps, total=t.steps - cfg.warm_start_steps,
                warmup=self._rewarm(t), restart_warmup=cfg.restart_warmup_steps,
                every=cfg.reset_every, min_ratio=t.min_lr_ratio,
            )
        since = step % cfg.reset_every
        warmup = cfg.restart_warmup_steps
        if step < cfg.reset_every or since >= warmup:
            return lr_factor(step, run.train)
        # the ramp ends on the global value of its last step
        return (since + 1) / warmup * lr_factor(step - since + warmup - 1, run.train)


def cosine_restarts(k: int, *, total: int, warmup: int, restart_warmup: int, every: int,
                    min_ratio: float) -> float:
    """The reference's `cosine_restarts` LR factor at step k of its run (from 0): a linear
    warmup from 0, a cosine over the run, and from the second cycle a ramp from 0 at each
    cycle's start up to the cosine's value at the ramp's end."""
    def cosine(progress: float) -> float:
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    if k < warmup:
        return k / max(1, warmup)
    since, cycle = k % every, k // every
    if since < restart_warmup and k >= every:
        end = (cycle * every + restart_warmup - warmup) / max(1, total - warmup)
        return since / max(1, restart_warmup) * cosine(end)
    return cosine((k - warmup) / max(1, total - warmup))


def merge_and_redraw(layer: LoraLayer, init: str) -> None:
    """W += s·B·A, then a fresh pair written into the same Parameters the optimizer holds.
    Under fsdp W and B hold the same rows, so this rank's rows of B·A are B's rows times the
    whole A; the pair is drawn whole on plain tensors, from the generator every rank holds
    alike, as one process draws it, and each rank keeps its rows."""
    weight = layer.get_base_layer().weight
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    if Rows(weight).sharded:
        delta = Rows(b).local.float() @ Rows(a).whole().float() * layer.scaling[ADAPTER]
        Rows(weight).local.add_(delta.to(weight.dtype))
    else:
        weight.add_(layer.get_delta_weight(ADAPTER))
    for module, held in ((layer.lora_A[ADAPTER], a), (layer.lora_B[ADAPTER], b)):
        module.weight = nn.Parameter(torch.empty(held.shape, dtype=held.dtype,
                                                 device=Rows(held).local.device))
    if init == "orthogonal":
        layer.orthogonal_init(ADAPTER)  # peft assigns new Parameters: copied back below
    else:
        layer.reset_lora_parameters(ADAPTER, PEFT_INIT[init])
    for module, held in ((layer.lora_A[ADAPTER], a), (layer.lora_B[ADAPTER], b)):
        Rows(held).local.copy_(Rows(held).mine(module.weight))
        module.weight = held


def reset_moments(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], cfg: ReLoraParams
) -> float:
    """Prune (as `cfg.prune` says) or zero the adapters' moments in place.

    Returns the fraction of moment entries that are zero afterwards.
    """
    zeros = total = 0
    for p in params:
        for key in MOMENTS:
            moment = optimizer.state.get(p, {}).get(key)
            if moment is None:
                continue
            rows = Rows(moment).local  # under fsdp this rank's rows; the mask is the whole's
            if cfg.optimizer_reset == "full":
                rows.zero_()
            elif cfg.prune == "random":
                keep = torch.rand(moment.shape, dtype=rows.dtype, device=rows.device)
                rows.mul_(Rows(moment).mine(keep) > cfg.prune_ratio)
            else:
                whole = Rows(moment).whole()
                rows.mul_(rows.abs() > magnitude_threshold(whole, cfg.prune_ratio))
            zeros += int((rows == 0).sum())
            total += rows.numel()
    if any(Rows(p).sharded for p in params):  # each rank counted its own rows
        zeros, total = (int(n) for n in Rows.total(torch.tensor([zeros, total])))
    return zeros / total if total else 0.0


def magnitude_threshold(moment: torch.Tensor, ratio: float) -> torch.Tensor:
    """The `ratio` quantile of |moment| over the whole tensor (linear interpolation), in its
    dtype: entries at or below it are zeroed, as the reference's `magnitude_pruning_`. Two
    order statistics instead of torch.quantile, which refuses tensors over 2^24 entries."""
    flat = moment.detach().abs().flatten().float()
    position = ratio * (flat.numel() - 1)
    low = math.floor(position)
    below = flat.kthvalue(low + 1).values
    above = flat.kthvalue(min(low + 2, flat.numel())).values
    return torch.lerp(below, above, position - low).to(moment.dtype)
