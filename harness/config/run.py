"""Typed configs for a run and a sweep, loaded strictly from YAML.

Every error is a `UserError` whose one-line message names the key path, the bad value and
what is allowed, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from harness.config.model_options import ModelOptions
from harness.config.strict import Strict

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "sample")


class TaskConfig(Strict):
    kind: Literal["pretrain", "glue"] = "pretrain"
    glue_task: str = Field(
        "sample", description="glue: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, or sample"
    )
    dataset: str = Field(
        "sample",
        description="pretrain: sample | c4 (hub, streaming) | dir or glob of C4 json.gz train "
        "shards; glue: hub (nyu-mll/glue) | dir of GLUE-schema files",
    )
    validation: str | None = Field(
        None, description="glob of validation shards (default: derived from dataset)"
    )
    tokenizer: str = Field("sample", description="sample | hub name (t5-base) | local directory")
    seq_len: int = Field(256, ge=2)
    packing: bool = Field(
        True, description="pack documents with EOS between them; false = truncate and pad"
    )
    shuffle_buffer: int = Field(1000, ge=1, description="documents held for the seeded shuffle")
    padding: Literal["longest", "max_length"] = Field(
        "longest", description="glue: pad each batch to its longest example, or to seq_len"
    )
    classifier_dropout: float | None = Field(
        None, ge=0, lt=1, description="glue: dropout before the classification head (model's own)"
    )

    @model_validator(mode="after")
    def _glue_fits(self) -> TaskConfig:
        if self.kind == "glue" and self.glue_task not in GLUE_TASKS:
            allowed = ", ".join(GLUE_TASKS)
            raise ValueError(f"glue_task: '{self.glue_task}' is not a task (allowed: {allowed})")
        if self.kind == "glue" and self.glue_task != "sample" and self.dataset == "sample":
            raise ValueError(
                f"dataset: 'sample' holds only the embedded task; GLUE {self.glue_task} reads "
                "from hub (nyu-mll/glue) or a folder of GLUE-schema files"
            )
        return self


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
                    "update_chunk": None, "loss_chunk": 0, "tf32": False, "shard_group": None}
SHARDED = ("fsdp", "hsdp")  # the strategies that shard weights, gradients and states
# Method settings added after trials had run, at the value that does what those trials did:
# left out of a trial's id there, so that earlier sweeps' finished trials stay finished.
LATER_METHOD_KEYS = {
    "qgalore": {"lazy_schedule": "ours", "clip_int8": True, "simulate_mode": "fake_quant",
                "snap_rounding": "stochastic"},
    "relora": {"prune": "magnitude", "decay_vectors": False},
    "apollo": {"int8_weights": False, "weight_group": 256, "decay_vectors": False},
    "apollo_mini": {"int8_weights": False, "weight_group": 256, "decay_vectors": False},
}
WARM_START_KEYS = ("warm_start", "warm_start_warmup_steps")  # ReLoRA's: idle without warm start


class TrainConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    steps: int | None = Field(None, ge=1, description="optimizer steps (default 100)")
    epochs: int | None = Field(
        None, ge=1, description="glue: passes over the training set, instead of steps"
    )
    batch_size: int = Field(8, ge=1, description="micro-batch (sequences per forward)")
    total_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
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


class EvalConfig(Strict):
    every: int = Field(0, ge=0, description="steps between evaluations (0: only at the end)")
    tokens: int = Field(100_000, ge=1, description="validation tokens per evaluation (papers: 10M)")
    batch_size: int | None = Field(None, ge=1)


class WandbConfig(Strict):
    enabled: bool = False
    mode: Literal["offline", "online"] = "offline"
    project: str = "harness"
    entity: str | None = None


MODULE_KINDS = ("attention", "mlp", "norm")


def _module_kinds(value: Any, words: tuple[str, ...]) -> Any:
    """`none` (and `full` for recompute) or a non-empty list of module kinds, without repeats."""
    allowed = f"{', '.join(words)}, or a list of {', '.join(MODULE_KINDS)}"
    if isinstance(value, str) and value in words:
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"{value!r} is not allowed (allowed: {allowed})")
    for kind in value:
        if kind not in MODULE_KINDS:
            raise ValueError(f"{kind!r} is not a module kind (allowed: {allowed})")
    if len(set(value)) < len(value):
        raise ValueError(f"{value!r} names a module kind twice")
    return value


class MemoryConfig(Strict):
    """Memory modifiers, orthogonal to the method (harness/modifiers applies them)."""

    recompute: str | list[str] = Field(
        "none", description="none | full (every decoder layer) | a list of attention, mlp, norm"
    )
    offload: str | list[str] = Field(
        "none", description="none | a list of module kinds whose saved activations go to host"
    )
    offload_min_bytes: int = Field(
        1 << 20, ge=0, description="saved tensors smaller than this stay on the device"
    )
    optimizer_offload: Literal["none", "host", "paged"] = Field(
        "none", description="host: states on the CPU, updated there; paged: bitsandbytes paged"
    )
    layerwise: bool = Field(False, description="each parameter's update runs inside backward")

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute(cls, value: Any) -> Any:
        return _module_kinds(value, ("none", "full"))

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, value: Any) -> Any:
        return _module_kinds(value, ("none",))

    @model_validator(mode="after")
    def _disjoint(self) -> MemoryConfig:
        if self.recompute == "full" and self.offloaded:
            raise ValueError(
                "recompute: full keeps no activations inside decoder layers, so offload has "
                "nothing to move; recompute a list of module kinds and offload the others"
            )
        both = [k for k in self.recomputed if k in self.offloaded]
        if both:
            raise ValueError(
                f"{both[0]} is both recomputed and offloaded; a recomputed module saves "
                "nothing to offload (give each module kind one of the two)"
            )
        return self

    @property
    def recomputed(self) -> list[str]:
        return self.recompute if isinstance(self.recompute, list) else []

    @property
    def offloaded(self) -> list[str]:
        return self.offload if isinstance(self.offload, list) else []


class ModelFrom(Strict):
    """A harness pretraining trial (its folder) or a sweep (its best trial) to fine-tune."""

    from_: str = Field(alias="from", description="runs/<sweep>/trials/<id>, or runs/<sweep>")
    sweep: str | None = Field(
        None, description="the pretraining sweep file, run first (into `from`) when it is absent"
    )
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class Common(Strict):
    """Keys a sweep shares with every trial it runs."""

    model: str | ModelFrom = Field(
        "llama_tiny",
        description="a preset (llama_tiny…llama_7b), or a LLaMA-layout decoder's (llama, "
        "mistral, qwen2…) Hugging Face config: a folder holding config.json (with weights: "
        "continued pretraining from them), a config.json file or a hub name; glue also: a hub "
        "name or local path of an encoder, or {from: runs/<sweep>[/trials/<id>]} for a harness "
        "LLaMA checkpoint",
    )
    model_options: ModelOptions = ModelOptions()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    memory: MemoryConfig = MemoryConfig()
    wandb: WandbConfig = WandbConfig()

    @model_validator(mode="after")
    def _precision_fits(self) -> Common:
        if self.train.precision == "16-mixed" and self.memory.layerwise:
            raise ValueError(
                "memory.layerwise with train.precision fp16 (16-mixed): loss scaling skips a "
                "whole step when any gradient overflows, but layer-wise updates have already "
                "applied the layers whose gradients came first; use bf16-mixed, or turn "
                "layerwise off"
            )
        if self.train.compile and self.memory.offloaded:
            raise ValueError(
                "train.compile with memory.offload: offload's saved-tensor hooks cannot be "
                "traced into a compiled layer; use memory.recompute, or train.compile: false"
            )
        return self


class RunConfig(Common):
    name: str = "run"
    label: str | None = Field(None, description="the method's name in its sweep")
    seed: int = 0
    method: dict[str, Any] = Field(default_factory=lambda: {"name": "full"})
    provenance: dict[str, Any] | None = Field(None, description="written by the harness")
    _settings: Any = PrivateAttr(None)  # the method's typed settings, once resolved

    def set_method(self, name: str, settings: BaseModel) -> None:
        """The method's typed settings, validated once against its registered class
        (harness.methods.resolve); `method` keeps their dump, for config.yaml and `identity`."""
        self.method = {"name": name, **settings.model_dump()}
        self._settings = settings

    @property
    def method_settings(self) -> Any:
        """The typed settings `set_method` was given (None until the run is resolved)."""
        return self._settings

    @property
    def method_name(self) -> str:
        return self.method["name"]

    @property
    def method_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.method.items() if k != "name"}

    def identity(self) -> str:
        """Stable hash of everything that changes results (not the name, logging or provenance)."""
        data = self.model_dump(exclude={"name", "label", "provenance", "wandb"})
        # bookkeeping: the same results
        for key in ("log_every", "keep_checkpoints", "checkpoint_async", "keep_final",
                    "peer_timeout_s"):
            data["train"].pop(key)
        # Hash what earlier versions wrote, so that their finished trials stay finished.
        legacy = {new: old for old, new in PRECISION_ALIASES.items()}
        data["train"]["precision"] = legacy.get(self.train.precision, self.train.precision)
        for key, default in LATER_TRAIN_KEYS.items():
            if data["train"][key] == default:
                del data["train"][key]
        if self.model_options == ModelOptions():  # added later: earlier trials built this
            del data["model_options"]
        data["method"] = _without_later_defaults(data["method"])
        blob = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:8]


def memory_label(memory: dict[str, Any]) -> str:
    """The memory modifiers in a few words ("recompute attention, offload mlp"; "none")."""
    parts = []
    for key in ("recompute", "offload"):
        value = memory.get(key, "none")
        if value != "none":
            parts.append(f"{key} {'+'.join(value) if isinstance(value, list) else value}")
    if memory.get("layerwise"):
        parts.append("layerwise")
    if memory.get("optimizer_offload", "none") != "none":
        parts.append(f"optimizer {memory['optimizer_offload']}")
    return ", ".join(parts) or "none"


def _without_later_defaults(method: dict[str, Any]) -> dict[str, Any]:
    """The method's settings less those LATER_METHOD_KEYS names at their old behaviour's value
    (and ReLoRA's warm-start keys when it has no warm start): what earlier versions hashed."""
    later = LATER_METHOD_KEYS.get(method.get("name"), {})
    idle = WARM_START_KEYS if method.get("warm_start_steps") == 0 else ()
    return {k: v for k, v in method.items()
            if k not in idle and not (k in later and v == later[k])}
