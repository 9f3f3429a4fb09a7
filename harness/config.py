"""Typed configs for a run and a sweep, loaded strictly from YAML.

Every error is a `UserError` whose one-line message names the key path, the bad value and
what is allowed, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit code 2."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskConfig(Strict):
    kind: Literal["pretrain"] = "pretrain"
    dataset: str = Field(
        "sample",
        description="sample | c4 (hub, streaming) | dir or glob of C4 json.gz train shards",
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


class LossScaleConfig(Strict):
    """fp16's dynamic loss scaling (torch.amp.GradScaler): an overflowing step is skipped and
    the scale backs off; `growth_interval` clean steps in a row grow it."""

    init: float = Field(2.0**16, gt=0, description="the first step's scale")
    growth_factor: float = Field(2.0, gt=1, description="multiplies the scale after the interval")
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="multiplies it on an overflow")
    growth_interval: int = Field(2000, ge=1, description="clean steps before the scale grows")


class TrainConfig(Strict):
    lr: float = Field(1e-3, gt=0)
    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1, description="micro-batch (sequences per forward)")
    total_batch_size: int | None = Field(None, ge=1, description="sequences per optimizer step")
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16/fp16: autocast over fp32 weights; fp16 scales the loss"
    )
    loss_scale: LossScaleConfig = LossScaleConfig()
    grad_clip: float | None = Field(1.0, gt=0)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(
        0, ge=0, description="steps between checkpoints (0: only at the end)"
    )

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainConfig:
        total = self.total_batch_size or self.batch_size
        if total % self.batch_size:
            raise ValueError(
                f"total_batch_size {total} is not a multiple of batch_size {self.batch_size}"
            )
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
    """Memory modifiers, orthogonal to the method (harness/memory.py applies them)."""

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


class Common(Strict):
    """Keys a sweep shares with every trial it runs."""

    model: str = "llama_tiny"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    memory: MemoryConfig = MemoryConfig()
    wandb: WandbConfig = WandbConfig()

    @model_validator(mode="after")
    def _precision_fits(self) -> Common:
        if self.train.precision == "fp16" and self.memory.layerwise:
            raise ValueError(
                "memory.layerwise with train.precision fp16: loss scaling skips a whole step "
                "when any gradient overflows, but layer-wise updates have already applied the "
                "layers whose gradients came first; use bf16, or turn layerwise off"
            )
        return self


class RunConfig(Common):
    name: str = "run"
    label: str | None = Field(None, description="the method's name in its sweep")
    seed: int = 0
    method: dict[str, Any] = Field(default_factory=lambda: {"name": "full"})
    provenance: dict[str, Any] | None = Field(None, description="written by the harness")

    @property
    def method_name(self) -> str:
        return self.method["name"]

    @property
    def method_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.method.items() if k != "name"}

    def identity(self) -> str:
        """Stable hash of everything that changes results (not the name, logging or provenance)."""
        data = self.model_dump(exclude={"name", "label", "provenance", "wandb"})
        data["train"].pop("log_every")
        blob = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:8]


class SearchConfig(Strict):
    sampler: Literal["grid", "random", "tpe", "cmaes"] = "grid"
    space: dict[str, Any] = Field(
        default_factory=dict,
        description="grid: dotted key -> list of values; other samplers: key -> distribution",
    )
    metric: Literal["eval_ppl", "eval_loss"] = "eval_ppl"
    direction: Literal["minimize", "maximize"] = "minimize"
    n_trials: int | None = Field(None, ge=1, description="Optuna trials per method")
    timeout_min: float | None = Field(None, gt=0, description="stop asking new trials after this")
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list, description="fixed points each method's study tries first"
    )
    pruner: Literal["none", "median", "hyperband"] = "none"
    heartbeat_s: int = Field(
        60, ge=1, description="database storage: a trial silent 3x this long is retried"
    )

    @model_validator(mode="after")
    def _fits_sampler(self) -> SearchConfig:
        from harness.space import check_distributions, check_space

        if self.sampler == "grid":
            extra = [k for k in ("n_trials", "timeout_min") if getattr(self, k) is not None]
            extra += ["enqueue"] * bool(self.enqueue) + ["pruner"] * (self.pruner != "none")
            if extra:
                raise ValueError(
                    f"{extra[0]} needs an Optuna sampler (random, tpe, cmaes), not grid"
                )
            check_space(self.space, "search.space")
        elif self.n_trials is None:
            raise ValueError(
                f"n_trials is required for sampler '{self.sampler}' "
                "(the number of trials per method)"
            )
        else:
            check_distributions(self.space, "search.space")
        return self


class LauncherConfig(Strict):
    """Where trials run; the Slurm keys may come from a named profile in `slurm/<name>.yaml`."""

    kind: Literal["local", "submitit-local", "slurm"] = "local"
    jobs: int = Field(1, ge=1, description="trials run at once (Optuna: workers)")
    profile: str | None = Field(None, description="cluster profile: slurm/<profile>.yaml")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    nodes: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1, description="processes per node (DDP ranks)")
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int | None = Field(None, ge=1)
    mem: str | None = Field(None, description="memory per node, e.g. 64G")
    timeout_min: int = Field(60, ge=1, description="time limit per job; it requeues after it")
    signal_delay_s: int = Field(90, ge=1, description="USR2 this long before the time limit")
    max_timeouts: int = Field(3, ge=0, description="requeues after a time limit (preemption: any)")
    array_parallelism: int | None = Field(None, ge=1, description="default: jobs")
    sbatch: dict[str, str | int | bool] = Field(
        default_factory=dict, description="extra #SBATCH options, e.g. {exclusive: true}"
    )
    setup: list[str] = Field(
        default_factory=list, description="shell lines run first (module load, conda activate)"
    )

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node


class SweepConfig(Common):
    name: str
    methods: dict[str, dict[str, Any]] = Field(min_length=1)
    search: SearchConfig = Field(default_factory=SearchConfig)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    launcher: LauncherConfig = LauncherConfig()
    storage: str | None = Field(
        None, description="Optuna storage: a journal file path or a database URL"
    )

    @model_validator(mode="after")
    def _launcher_fits(self) -> SweepConfig:
        if self.launcher.ranks > 1 and self.launcher.kind == "local":
            raise ValueError(
                "launcher: nodes x tasks_per_node > 1 (a DDP trial) needs kind submitit-local "
                "or slurm (or run `torchrun ... harness train`)"
            )
        if self.launcher.ranks > 1 and self.search.sampler != "grid":
            raise ValueError(
                "launcher: DDP trials (nodes x tasks_per_node > 1) run in grid sweeps; "
                "Optuna workers run one process each"
            )
        return self


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys at the top level")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"{key}: '{part}' is not a mapping, cannot set a key inside it")
        node = child
    node[parts[-1]] = value


def parse_overrides(sets: list[str]) -> dict[str, Any]:
    """`--set a.b=1` pairs; values are YAML, so 1e-3, true and [1, 2] mean what they look like."""
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KEY=VALUE (e.g. train.steps=20), got '{item}'")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise UserError(f"--set {key}: value '{raw}' is not valid YAML") from None
    return out


def validate(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """Validate and turn pydantic's report into one line naming the key path and what is allowed."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UserError(_explain(model, e.errors()[0], prefix, len(e.errors()))) from None


def _explain(model: type[BaseModel], err: dict[str, Any], prefix: str, count: int) -> str:
    loc = [str(p) for p in err["loc"]]
    path = (prefix + ".".join(loc)).rstrip(".")
    more = f" (and {count - 1} more problem{'s' * (count > 2)})" if count > 1 else ""
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"unknown key '{path}' ({hint}allowed: {', '.join(allowed)}){more}"
    if kind == "missing":
        return f"missing key '{path}'{more}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{path}: {value!r} is not allowed (allowed: {expected}){more}"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return f"{path or 'config'}: {msg}{more}"
    return f"{path}: {value!r} is invalid ({msg}){more}"


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """Field names of the nested model at `loc`, for 'allowed:' lists and suggestions."""
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if hasattr(current, "model_fields") else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return []
        current = field.annotation
    return list(current.model_fields)


def suggest(name: str, choices: list[str], what: str, path: str) -> UserError:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return UserError(f"{path}: unknown {what} '{name}' ({hint}allowed: {', '.join(choices)})")


def resolve_method(spec: dict[str, Any], path: str) -> dict[str, Any]:
    """Check a method spec against the registry and its typed config; return it with defaults."""
    from harness.methods import get_method

    spec = dict(spec)
    name = spec.pop("name", None)
    if not isinstance(name, str):
        raise UserError(f"missing key '{path}.name' (a method name; see `harness methods`)")
    params = validate(get_method(name, f"{path}.name").Config, spec, prefix=f"{path}.")
    return {"name": name, **params.model_dump()}


def load_run(data: dict[str, Any], overrides: dict[str, Any] | None = None) -> RunConfig:
    from harness.models import check_preset

    data = json.loads(json.dumps(data, default=str))
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    run = validate(RunConfig, data)
    run.method = resolve_method(run.method, "method")
    check_preset(run.model, "model")
    check_modifiers(run)
    return run


def check_modifiers(run: RunConfig) -> None:
    """Refuse, with the method's reason, memory modifiers or a precision it cannot honour."""
    from harness.methods import build_method

    reason = build_method(run).refusal(run)
    if reason:
        raise UserError(f"method {run.method_name}: {reason}")
