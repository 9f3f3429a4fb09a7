"""The method interface and registry. A method is one file that registers one class, and a
companion beside it (methods/<file>_memory.py) that registers its byte arithmetic:

    @register("lion")                                # methods/lion.py
    class Lion(Method):
        summary = "Lion: the sign of an interpolated momentum"
        Config = LionConfig                          # typed, validated hyperparameters
        def optimizer(self, groups, run): ...        # over param groups (the one required hook)
        # optional, each with a default:
        def check(self, run) -> Terms: ...           # refusals, fsdp, a warning, its LR schedule
        def prepare(self, model, run): ...           # wrap, quantize, factor or freeze modules
        def groups(self, model, run): ...            # param groups (default: decay on matrices)
        def on_step(self, step, model, optimizer): ...   # work after a step; returns events
        def export(self, model): ...                 # the plain model transformers saves

    @register_memory("lion")                         # methods/lion_memory.py
    class LionMemory(Memory):
        def estimate(self, shapes, run): ...         # bytes from shapes; `measure` counts them

The harness, not the method, wraps the optimizer for the memory modifiers (`optimizer_for`) and
builds the LR schedule (`schedule_of`); under fsdp an optimizer asks harness/distributed/rows.py
(`Rows`) for its rows, gathers and sums. The two classes share the typed settings and nothing
else: harness/cost and `harness bench memory` build the companion (`build_memory`,
`memory_of`), never the training class, so how a method trains cannot move its estimate. Every
registered method has a companion registered under its name in the module named after its own
with `_memory` (checked as harness.methods is imported: `check_companions`); no list elsewhere
names the methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from harness.config import Strict
from harness.config.steps import Steps, lr_factor
from harness.errors import suggest
from harness.methods.memory import Memory
from harness.modifiers.optimizer import make_optimizer

if TYPE_CHECKING:
    from harness.config import RunConfig

Groups = list[dict[str, Any]]  # optimizer parameter groups: {"params": [...], settings...}
_REGISTRY: dict[str, type[Method]] = {}
_MEMORY: dict[str, type[Memory]] = {}
NOT_SHARDED = ("its optimizer does not take sharded parameters yet; use train.parallel: ddp "
               "(docs/scale-out.md lists the methods fsdp trains)")


@dataclass(frozen=True)
class Terms:
    """What a method makes of a run before it starts, from the settings alone: read when the
    run is loaded (methods/resolve.py refuses, in one line) and when the trainer sets up."""

    refusal: str | None = None  # why it cannot honour the run's memory modifiers or precision
    # Why it cannot train under `train.parallel: fsdp` (None: it can, taking FSDP's sharded
    # parameters through harness/distributed/rows.py): refused until a method says it shards.
    fsdp: str | None = NOT_SHARDED
    # One line said at load time and kept in the summary: a valid setting that departs from
    # the method's reference (e.g. ReLoRA's merges inside the warmup).
    warning: str | None = None
    # The LR multiplier of each step (from 0); None: the run's schedule (warmup, then decay).
    lr_factor: Callable[[int], float] | None = None
    # Its optimizer updates the weights inside backward itself (INT8 layers): the trainer
    # hands it the groups as they are, neither split per parameter nor moved to the host.
    in_backward: bool = False


class Method:
    """A method's training side: six hooks, each with a default but `optimizer`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Config: ClassVar[type[Strict]] = Strict
    # What the method is meant for: "pretrain" (from scratch) and "finetune" (a pretrained
    # model); `tasks_note` says why where it is one of them. `harness plan` (pretraining) lists
    # a method without "pretrain" apart, with the note.
    tasks: ClassVar[tuple[str, ...]] = ("pretrain", "finetune")
    tasks_note: ClassVar[str] = ""

    def __init__(self, config: Strict, steps: Steps) -> None:
        self.config = config
        self.steps = steps  # the run's step arithmetic, which its companion reads (`memory_of`)

    def check(self, run: RunConfig) -> Terms:
        """Whether and how it trains `run` (refusals, a warning, its LR schedule)."""
        return Terms()

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        """The model as the method trains it: wrapped, quantized, factored or frozen."""
        return model

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """The trainable parameters in groups of shared settings (decay on matrices only), as
        the model holds them after `prepare` and, under fsdp, sharding."""
        return decay_groups(model, run.train.weight_decay)

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """The method's optimizer over `groups`: all of them, or one parameter's when the run is
        layer-wise (`optimizer_for` does what the memory modifiers ask)."""
        raise NotImplementedError

    def on_step(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """After each optimizer step (e.g. ReLoRA's merge and reset); what it returns is logged."""
        return None

    def export(self, model: nn.Module) -> nn.Module:
        """The trained model (after `prepare`, its state loaded) as the plain model its base
        was, which transformers saves and loads: adapters merged, quantized weights
        dequantized, factors multiplied out. The default: the model as it is."""
        return model


def optimizer_for(method: Method, model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
    """The method's optimizer over `model` as the memory modifiers ask: per parameter inside
    backward (layerwise), with its states on the host (optimizer_offload: host); an optimizer
    that updates inside backward itself (`Terms.in_backward`) as it is."""
    groups = method.groups(model, run)
    if method.check(run).in_backward:
        return method.optimizer(groups, run)
    groups = [g for g in groups if g["params"]]
    return make_optimizer(groups, lambda gs: method.optimizer(gs, run), run)


def unpaged(run: RunConfig, states: str, one: bool = False) -> str | None:
    """Why an optimizer that keeps its `states` as its own tensors (`one`: a single kind)
    refuses `memory.optimizer_offload: paged`, which pages bitsandbytes' optimizers' states."""
    if run.memory.optimizer_offload != "paged":
        return None
    own, they = ("is its own tensor", "it") if one else ("are its own tensors", "they")
    return (f"its {states} {own}, not a bitsandbytes optimizer's, so {they} cannot be paged; "
            "use memory.optimizer_offload: host")


def schedule_of(method: Method, run: RunConfig) -> Callable[[int], float]:
    """The LR multiplier of each step: the method's (`Terms.lr_factor`), else the run's; a
    plain function, which LambdaLR leaves out of its state_dict (nothing of it to resume)."""
    own = method.check(run).lr_factor
    return (lambda s: own(s)) if own is not None else (lambda s: lr_factor(s, run.train))


def register(name: str) -> Callable[[type[Method]], type[Method]]:
    """A method class, registered as `name`."""
    return _entry(_REGISTRY, name)


def register_memory(name: str) -> Callable[[type[Memory]], type[Memory]]:
    """The companion of the method registered as `name`."""
    return _entry(_MEMORY, name)


def _entry(table: dict[str, Any], name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        cls.name = name
        table[name] = cls
        return cls

    return wrap


def get_method(name: str, path: str = "method") -> type[Method]:
    if name not in _REGISTRY:
        raise suggest(name, sorted(_REGISTRY), "method", path)
    return _REGISTRY[name]


def get_memory(name: str, path: str = "method") -> type[Memory]:
    get_method(name, path)  # an unknown name: the same one line
    return _MEMORY[name]


def check_companions() -> None:
    """Every registered method has its companion, in the module named after its own."""
    for name, cls in _REGISTRY.items():
        companion = _MEMORY.get(name)
        if companion is None or companion.__module__ != f"{cls.__module__}_memory":
            raise TypeError(f"method {name} ({cls.__module__}) has no Memory registered as "
                            f"{name!r} in {cls.__module__}_memory")


def method_names() -> list[str]:
    return list(_REGISTRY)


def build_method(run: RunConfig, steps: Steps | None = None) -> Method:
    """The run's method on the typed settings `load_run` validated (methods/resolve.py), for
    `steps` (default: one process)."""
    return get_method(run.method_name)(*_settings(run, steps))


def build_memory(run: RunConfig, steps: Steps | None = None) -> Memory:
    """The run's method's companion, as `build_method` builds the method."""
    return get_memory(run.method_name)(*_settings(run, steps))


def memory_of(method: Method) -> Memory:
    """The companion of a built method, on its settings and step arithmetic."""
    return get_memory(method.name)(method.config, method.steps)


def _settings(run: RunConfig, steps: Steps | None) -> tuple[Strict, Steps]:
    if run.method_settings is None:
        raise ValueError("build_method takes a run from load_run, which validates its method")
    return run.method_settings, steps or Steps.of(run.train, run.task.seq_len)


def changed_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters set away from the method's defaults: the ones that tell trials apart."""
    fields = get_method(name).Config.model_fields
    defaults = {k: f.get_default(call_default_factory=True) for k, f in fields.items()}
    return {k: v for k, v in params.items() if defaults.get(k) != v}


def decay_groups(model: nn.Module, weight_decay: float,
                 vectors: bool = False) -> list[dict[str, Any]]:
    """Weight decay on matrices; on norms and biases only with `vectors` (some references
    decay every parameter: docs/fidelity.md)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2],
         "weight_decay": weight_decay if vectors else 0.0},
    ]
