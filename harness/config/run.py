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
from harness.config.train import LATER_TRAIN_KEYS, PRECISION_ALIASES, TrainConfig

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
    read_shards: int | None = Field(
        None, ge=1, description="pretrain, data parallel: the stream interleaves this many "
        "file shards, each rank reading only its own (a multiple of the ranks; default: every "
        "rank reads the whole stream)"
    )
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
        if self.kind == "glue" and self.read_shards is not None:
            raise ValueError("read_shards: splits pretraining text only (GLUE reads its splits "
                             "whole; allowed: unset)")
        if self.kind == "glue" and self.glue_task != "sample" and self.dataset == "sample":
            raise ValueError(
                f"dataset: 'sample' holds only the embedded task; GLUE {self.glue_task} reads "
                "from hub (nyu-mll/glue) or a folder of GLUE-schema files"
            )
        return self


# Method settings added after trials had run, at the value that does what those trials did:
# left out of a trial's id there, so that earlier sweeps' finished trials stay finished.
LATER_METHOD_KEYS = {
    "qgalore": {"lazy_schedule": "ours", "clip_int8": True, "simulate_mode": "fake_quant",
                "snap_rounding": "stochastic"},
    "relora": {"prune": "magnitude", "decay_vectors": False},
    "apollo": {"int8_weights": False, "weight_group": 256, "decay_vectors": False},
    "apollo_mini": {"int8_weights": False, "weight_group": 256, "decay_vectors": False},
    "galore": {"projection_after": None},  # GoLore's switch: SVD throughout without it
}
LATER_TASK_KEYS = {"read_shards": None}  # task settings added later, as LATER_METHOD_KEYS
WARM_START_KEYS = ("warm_start", "warm_start_warmup_steps")  # ReLoRA's: idle without warm start


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
        for key, default in LATER_TASK_KEYS.items():
            if data["task"][key] == default:
                del data["task"][key]
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
