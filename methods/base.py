"""The method interface and registry: a method is one file that registers one class."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from harness.config import Strict
from harness.config.steps import Steps, lr_factor
from harness.distributed import fsdp
from harness.errors import suggest
from harness.methods.widths import widths
from harness.modifiers.optimizer import make_optimizer

if TYPE_CHECKING:
    from harness.config import RunConfig

# The papers' targets for adapters, factors and projections: every attention and MLP linear.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Shapes = dict[str, torch.Size]  # parameter name -> shape, of the base model before `prepare`
Groups = list[dict[str, Any]]  # optimizer parameter groups: {"params": [...], settings...}
_REGISTRY: dict[str, type[Method]] = {}


@dataclass
class MemoryEstimate:
    """Bytes training keeps besides activations: predicted by `estimate`, counted by `measure`."""

    weight_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    extra_bytes: int = 0  # projections, quantization constants: neither weights nor moments

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_state_bytes + self.extra_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


class Method:
    """Prepares the model, builds the optimizer, hooks each step, and predicts its memory."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Config: ClassVar[type[Strict]] = Strict
    # What the targeted linears become, for the activation model (harness/cost/activations.py):
    # "float" (trained as they are), "adapter" (frozen, plus rank-r adapters), "factored"
    # (two rank-r factors) or "quantized" (codes, no float weight for autocast to copy).
    linears: ClassVar[str] = "float"
    # What the method is meant for: "pretrain" (from scratch) and "finetune" (a pretrained
    # model); `tasks_note` says why where it is one of them. `harness plan` (pretraining) lists
    # a method without "pretrain" apart, with the note.
    tasks: ClassVar[tuple[str, ...]] = ("pretrain", "finetune")
    tasks_note: ClassVar[str] = ""

    def __init__(self, config: Strict, steps: Steps) -> None:
        self.config = config
        self.steps = steps  # the run's step arithmetic: gradient memory depends on accumulation

    def prepare(self, model: nn.Module, run: RunConfig) -> nn.Module:
        return model

    def param_groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """The trainable parameters in groups of shared settings (decay on matrices only)."""
        return decay_groups(model, run.train.weight_decay)

    def build_optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """The method's optimizer over `groups`: all of them, or one parameter's when layer-wise."""
        raise NotImplementedError

    def optimizer(self, model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
        """`build_optimizer` as the memory modifiers ask: per parameter inside backward
        (layerwise), and with its states on the host (optimizer_offload: host)."""
        groups = [g for g in self.param_groups(model, run) if g["params"]]
        return make_optimizer(groups, lambda gs: self.build_optimizer(gs, run), run)

    def refusal(self, run: RunConfig) -> str | None:
        """Why this method cannot honour the run's memory modifiers or precision (None: it can)."""
        return None

    def fsdp_refusal(self, run: RunConfig) -> str | None:
        """Why this method cannot train under `train.parallel: fsdp` (None: it can). A method
        that can takes FSDP's sharded parameters (DTensors, harness/distributed/fsdp.py)."""
        return ("its optimizer does not take sharded parameters yet; use train.parallel: ddp "
                "(docs/scale-out.md lists the methods fsdp trains)")

    def warning(self, run: RunConfig) -> str | None:
        """One line said at load time and kept in the summary: a valid setting that departs
        from the method's reference (e.g. ReLoRA's merges inside the warmup); None: none."""
        return None

    def on_step(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """After each optimizer step (e.g. ReLoRA's merge and reset); what it returns is logged."""
        return None

    def lr_factor(self, step: int, run: RunConfig) -> float:
        """The LR multiplier for `step` (from 0); ReLoRA makes it jagged."""
        return lr_factor(step, run.train)

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """Bytes predicted from the base model's shapes and the hyperparameters alone."""
        raise NotImplementedError

    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """Bytes one weight's update holds beside the gradients at the step: where a bf16-true
        update is computed in float32 (`float32_update`), the update and the weight's float32
        copy (modifiers/compensation.add_update), of the largest weight (this default: every
        tensor trained so); 0 where kernels update the weights in place."""
        return update_bytes([numel(s) for s in shapes.values()], run)

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Rank 0's bytes under fsdp over `world` ranks (the largest share: ceil(m / world)
        rows of each tensor). Per-element states follow their tensor's rows; a method keeping
        states of another shape, or whole on every rank, overrides this."""
        return self.estimate(row_shards(shapes, world), run)

    def export(self, model: nn.Module) -> nn.Module:
        """The trained model (after `prepare`, its state loaded) as the plain model its base
        was, which transformers saves and loads: adapters merged, quantized weights
        dequantized, factors multiplied out. The default: the model as it is."""
        return model

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryEstimate:
        """Bytes counted from the real tensors after a step: gradient bytes are those in `.grad`
        now (a trial counts its peak over the step: harness/cost/grad_peak.py)."""
        params = list(model.parameters())
        return MemoryEstimate(
            weight_bytes=sum(tensor_bytes(p) for p in params),
            grad_bytes=live_grad_bytes(params),
            optimizer_state_bytes=tensor_bytes(list(optimizer.state.values())),
        )


def live_grad_bytes(params: list[nn.Parameter]) -> int:
    return tensor_bytes([p.grad for p in params])


def float32_update(run: RunConfig) -> bool:
    """Whether a bf16-true run's optimizers compute each update in float32 and round it into the
    weight (modifiers/compensation.py): with float32 moments or an update compensation. With
    bfloat16 moments and round to nearest they update the weights in place, as in 32-true."""
    t = run.train
    return t.precision == "bf16-true" and (t.state_dtype == "float32"
                                           or t.update_compensation != "none")


def update_bytes(sizes: list[int], run: RunConfig) -> int:
    """`Method.update_bytes` for trained tensors of `sizes`: two float32 copies of the largest."""
    return 8 * max(sizes) if float32_update(run) else 0


def grad_bytes_of(sizes: list[int], layerwise: bool, accumulation: int, width: int = 4,
                  float32: Collection[int] = ()) -> int:
    """Gradients of the trained tensors of `sizes`, `width` bytes an element (fp32: 4; bf16-true:
    2), and of INT8 layers (`float32`: their G is float32 whatever the precision). Layer-wise
    without accumulation (`accumulation`: micro-batches per step on one process) holds one at a
    time: the largest is the peak. With accumulation every one lives until the last
    micro-batch's backward."""
    grads = [width * n for n in sizes] + [4 * n for n in float32]
    if layerwise and accumulation == 1:
        return max(grads)
    return sum(grads)


def grad_bytes(sizes: list[int], run: RunConfig, steps: Steps) -> int:
    """The estimate's gradient bytes for the trained tensors of `sizes` under `run`."""
    return grad_bytes_of(sizes, run.memory.layerwise, steps.accumulation, widths(run).grad)


def register(name: str):
    def wrap(cls: type[Method]) -> type[Method]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def get_method(name: str, path: str = "method") -> type[Method]:
    if name not in _REGISTRY:
        raise suggest(name, sorted(_REGISTRY), "method", path)
    return _REGISTRY[name]


def method_names() -> list[str]:
    return list(_REGISTRY)


def build_method(run: RunConfig, steps: Steps | None = None) -> Method:
    """The run's method on the typed settings `load_run` validated (methods/resolve.py), for
    `steps` (default: one process)."""
    if run.method_settings is None:
        raise ValueError("build_method takes a run from load_run, which validates its method")
    steps = steps or Steps.of(run.train, run.task.seq_len)
    return get_method(run.method_name)(run.method_settings, steps)


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


def is_target(module: str, targets: Collection[str], anywhere: bool = False) -> bool:
    """Whether the linear named `module` is one of `targets`: by its last name component (peft's
    rule, which LoRA, QLoRA, ReLoRA and low-rank follow) or, `anywhere`, by any component
    (GaLore's and Q-GaLore's: `intermediate` selects intermediate.dense)."""
    parts = module.split(".")
    return any(p in targets for p in parts) if anywhere else parts[-1] in targets


def target_linears(model: nn.Module, targets: Collection[str],
                   anywhere: bool = False) -> list[tuple[str, nn.Linear]]:
    """The model's nn.Linear modules that `is_target`, with their names, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and is_target(name, targets, anywhere)]


def replace_linears(model: nn.Module, kind: type[nn.Module],
                    weight_of: Callable[[Any], torch.Tensor]) -> nn.Module:
    """Each `kind` module of `model` replaced by an nn.Linear holding `weight_of(module)`
    (out × in) and the module's bias: how an export turns a method's own linears back into the
    base model's."""
    for name, module in list(model.named_modules()):
        if isinstance(module, kind):
            model.set_submodule(name, plain_linear(weight_of(module), module.bias))
    return model


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of `weight` (out × in) and `bias`."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear


def row_share(shape: torch.Size | tuple[int, ...], world: int) -> tuple[int, ...]:
    """The rows of a `shape` tensor that rank 0 holds when FSDP splits dim 0 over `world`."""
    return (-(-shape[0] // world), *shape[1:]) if len(shape) else tuple(shape)


def row_shards(shapes: Shapes, world: int) -> Shapes:
    return {name: torch.Size(row_share(s, world)) for name, s in shapes.items()}


def numel(shape: torch.Size | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside nested dicts/lists (an optimizer's state); of a sharded
    tensor, this rank's shard: what this process holds."""
    if isinstance(obj, torch.Tensor):
        obj = fsdp.local(obj)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0
