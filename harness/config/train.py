"""The `train` section of a run: optimizer steps, batch, precision, parallel strategy and the
speed levers, checked as one typed config (a bad value is one line naming the key)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from harness.config.budget import BudgetMark
from harness.config.strict import Strict


class LossScaleConfig(Strict):
    """fp16's dynamic loss scaling (torch.amp.GradScaler): an overflowing step is skipped and
    the scale backs off; `growth_interval` clean steps in a row grow it."""

    init: float = Field(2.0**16, gt=0, description="the first step's scale")
    growth_factor: float = Field(2.0, gt=1, description="multiplies the scale after the interval")
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="multiplies it on an overflow")
    growth_interval: int = Field(2000, ge=1, description="clean steps before the scale grows")


# Today's names, as Lightning/Fabric users know them; the earlier names stay accepted.
PRECISION_ALIASES = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
PURE_BF16_KEYS = {"state_dtype": "float32", "update_compensation": "none"}  # key -> default
# Train settings added after trials had run: left out of a trial's id at their default, which
# is what those trials did, so that earlier sweeps' finished trials stay finished.
LATER_TRAIN_KEYS = {**PURE_BF16_KEYS, "parallel": "ddp", "reshard_after_forward": True,
                    "fsdp_reduce": "every",  # the same sums as "last", reduced in another order
                    "update_chunk": None, "loss_chunk": 0, "tf32": False, "shard_group": None,
                    "decay_fraction": 0.2, "budget": None}
SHARDED = ("fsdp", "hsdp")  # the strategies that shard weights, gradients and states

class TrainConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    steps: int | None = Field(None, ge=1, description="optimizer steps (default 100)")
    epochs: int | None = Field(
        None, ge=1, description="glue: passes over the training set, instead of steps"
    )
    batch_size: int = Field(8, ge=1, description="micro-batch (sequences per forward)")
    total_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="after linear warmup: cosine or linear decay to min_lr_ratio over "
        "the remaining steps, constant, or wsd (warmup-stable-decay: constant, then a linear "
        "decay to min_lr_ratio over the last decay_fraction of the steps)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: the fraction of steps, at the end, over which the LR "
        "decays (0.2: Hägele et al. 2024's cooldown that matches cosine)")
    budget: BudgetMark | None = Field(
        None, description="written by a sweep's budget: the token budget this trial belongs "
        "to (its steps are train.steps); the report groups trials by it")
    weight_decay: float = Field(0.0, ge=0)
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"] = Field(
        "32-true", description="bf16-mixed/16-mixed: autocast over fp32 weights (16-mixed "
        "scales the loss); bf16-true: weights, gradients and activations in bfloat16 (aliases: "
        "fp32, bf16, fp16)"
    )
    state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="bf16-true: dtype of the 32-bit optimizer states"
    )
    update_compensation: Literal["none", "stochastic_rounding", "kahan"] = Field(
        "none", description="bf16-true: how an update is added to a bf16 weight (none: "
        "round to nearest, as the GaLore reference code does)"
    )
    update_chunk: int | None = Field(
        None, ge=0, description="bf16-true: elements each multi-tensor update step takes at "
        "once (torch._foreach_*; its float32 temporaries are 8 bytes an element); 0: one "
        "parameter at a time; default: the device's, 2^20 on a CPU, 2^24 on a GPU"
    )
    loss_scale: LossScaleConfig = LossScaleConfig()
    parallel: Literal["ddp", "fsdp", "hsdp"] = Field(
        "ddp", description="a trial of several processes: ddp (each holds the whole model and "
        "its optimizer states), fsdp (weights, gradients and states sharded over them) or hsdp "
        "(sharded within groups of shard_group processes, replicated across the groups; "
        "docs/scale-out.md)"
    )
    shard_group: int | None = Field(
        None, ge=1, description="hsdp: the processes each weight is sharded over (e.g. a "
        "node's GPUs), a divisor of the world size; default: a node's, LOCAL_WORLD_SIZE"
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: a layer frees its gathered weights after its forward and "
        "gathers them again for backward; false keeps them (memory for one all-gather)"
    )
    fsdp_reduce: Literal["every", "last"] = Field(
        "every", description="fsdp with accumulation: reduce-scatter each micro-batch's "
        "gradients (every: a rank holds its shard of them, 1/W) or only the last's (last: whole "
        "gradients held between micro-batches, one reduce-scatter a step)"
    )
    grad_clip: float | None = Field(1.0, gt=0)
    compile: bool = Field(
        False, description="torch.compile each decoder layer (one graph each) and the loss; "
        "compiled in step 1, whose time is reported apart (compile_s)"
    )
    loss_chunk: int = Field(
        0, ge=0, description="pretrain: tokens whose logits exist at once, each chunk's "
        "recomputed in backward (bounds the logits' peak); 0: all of the micro-batch's"
    )
    tf32: bool = Field(
        False, description="32-true on CUDA: matmuls in TF32 (10-bit mantissa, several times "
        "the float32 FLOP/s; MFU is then against the TF32 peak)"
    )
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(
        0, ge=0, description="steps between checkpoints (0: only at the end)"
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="checkpoints kept, newest first: one that does not load on "
        "resume is skipped for the one before"
    )
    checkpoint_async: bool = Field(
        False, description="fsdp: write checkpoints in the background (torch's DCP async_save, "
        "staged in pinned host memory on CUDA), each published once written"
    )
    keep_final: Literal["weights", "full", "none"] = Field(
        "weights", description="what a trial that ends ok keeps: its model in Hugging Face "
        "format (weights), that and its training state (full), or neither (none)"
    )
    peer_timeout_s: float = Field(
        120, gt=0, description="a trial of several processes: one that has not answered for "
        "this long (stopped, frozen, gone) ends the trial interrupted, resumable"
    )

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainConfig:
        total = self.total_batch_size or self.batch_size
        if total % self.batch_size:
            raise ValueError(
                f"total_batch_size {total} is not a multiple of batch_size {self.batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _shard_group_fits(self) -> TrainConfig:
        if self.shard_group is not None and self.parallel != "hsdp":
            raise ValueError(f"shard_group applies to parallel hsdp only (this run is "
                             f"{self.parallel}); remove it or use parallel: hsdp")
        return self

    @property
    def sharded(self) -> bool:
        """fsdp or hsdp: weights, gradients and states are sharded when processes are many."""
        return self.parallel in SHARDED

    @field_validator("precision", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return PRECISION_ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _pure_bf16_only(self) -> TrainConfig:
        if self.precision != "bf16-true":
            for key, default in PURE_BF16_KEYS.items():
                if getattr(self, key) != default:
                    raise ValueError(f"{key} applies to precision bf16-true only (this run is "
                                     f"{self.precision}); remove it or use bf16-true")
        return self

    @model_validator(mode="after")
    def _decay_fraction_fits(self) -> TrainConfig:
        if self.decay_fraction != LATER_TRAIN_KEYS["decay_fraction"] and self.schedule != "wsd":
            raise ValueError(f"decay_fraction applies to schedule wsd only (this run's is "
                             f"{self.schedule}); remove it or use schedule: wsd")
        return self

    @model_validator(mode="after")
    def _tf32_fits(self) -> TrainConfig:
        if self.tf32 and self.precision != "32-true":
            raise ValueError(f"tf32 applies to precision 32-true only (this run is "
                             f"{self.precision}, whose matmuls are 16-bit); remove it")
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_steps(cls, data: Any) -> Any:
        """100 steps unless the budget is in epochs (the trainer counts their steps)."""
        if isinstance(data, dict) and data.get("epochs") is None and data.get("steps") is None:
            return {**data, "steps": 100}
        return data

    @model_validator(mode="after")
    def _one_budget(self) -> TrainConfig:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("set train.steps or train.epochs, not both")
        return self

    @property
    def accumulation(self) -> int:
        return (self.total_batch_size or self.batch_size) // self.batch_size
