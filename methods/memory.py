"""A method's byte arithmetic, apart from its training hooks: the `Memory` base class each
method's companion (methods/<file>_memory.py) extends, and the helpers they share.

A companion predicts the bytes training keeps besides activations from the base model's shapes
and the run's settings (`estimate`, `estimate_sharded`, `update_bytes`), and counts them from
the real tensors after a step (`measure`); harness/cost and `harness bench memory` read it
through the registry (methods/base.py `build_memory`, `memory_of`), never the training class.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from harness.config import Strict
from harness.config.steps import Steps
from harness.distributed.rows import Rows
from harness.methods.widths import widths
from harness.modifiers.multi_tensor import update_chunk

if TYPE_CHECKING:
    from harness.config import RunConfig

Shapes = dict[str, torch.Size]  # parameter name -> shape, of the base model before `prepare`


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


class Memory:
    """One method's bytes, on its typed settings and the run's step arithmetic."""

    name: ClassVar[str]
    # What the targeted linears become, for the activation model (harness/cost/activations.py):
    # "float" (trained as they are), "adapter" (frozen, plus rank-r adapters), "factored"
    # (two rank-r factors) or "quantized" (codes, no float weight for autocast to copy).
    linears: ClassVar[str] = "float"
    # `harness bench memory` checks this arithmetic on the method at `bench`, settings small
    # enough for any preset, and on each of `variants` (label -> settings naming their
    # "method"; a label ending in "layerwise" trains layer-wise).
    bench: ClassVar[dict[str, Any]] = {}
    variants: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, config: Strict, steps: Steps) -> None:
        self.config = config
        self.steps = steps  # the run's step arithmetic: gradient memory depends on accumulation

    def estimate(self, shapes: Shapes, run: RunConfig) -> MemoryEstimate:
        """Bytes predicted from the base model's shapes and the hyperparameters alone."""
        raise NotImplementedError

    def estimate_sharded(self, shapes: Shapes, run: RunConfig, world: int) -> MemoryEstimate:
        """Rank 0's bytes under fsdp over `world` ranks (hsdp: its shard group's; the largest
        share: ceil(m / world) rows of each tensor). Per-element states follow their tensor's
        rows; a method keeping states of another shape, or whole on every rank, overrides
        this."""
        return self.estimate(row_shards(shapes, world), run)

    # Whether the multi-tensor chunks of this method's optimizer hold whole tensors (the
    # fused AdamW kernel of GaLore's and APOLLO's unprojected path) rather than cut them.
    whole_chunks: ClassVar[bool] = False

    def update_bytes(self, shapes: Shapes, run: RunConfig) -> int:
        """Bytes the update holds beside the gradients at the step: where a bf16-true update
        is computed in float32 (`float32_update`), the update and the weights' float32 copy
        (modifiers/compensation.add_update) of what is updated at once: a chunk of at most
        `train.update_chunk` elements (`add_updates`), or one weight (update_chunk 0, and the
        tensors `updated_alone`); 0 where kernels update the weights in place."""
        if not float32_update(run):  # before the walk over every tensor: the planner asks often
            return 0
        alone, chunked = [], []
        for name, shape in shapes.items():
            (alone if self.updated_alone(name, tuple(shape), run) else chunked).append(numel(shape))
        return update_bytes(chunked, run, alone, self.whole_chunks)

    def updated_alone(self, name: str, shape: tuple[int, ...], run: RunConfig) -> bool:
        """Whether the step updates this tensor on its own, whatever `train.update_chunk` (a
        projected or orthogonalized matrix; this default: none, every tensor by chunks)."""
        return False

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


def update_bytes(sizes: list[int], run: RunConfig, alone: Collection[int] = (),
                 whole: bool = False) -> int:
    """`Memory.update_bytes` for trained tensors of `sizes` updated by chunks and of `alone`
    updated one at a time: two float32 copies of the most that is updated at once. A chunk
    holds min(update_chunk, what one step of one optimizer takes: every tensor, or one
    tensor when layer-wise); `whole`, chunks never cut a tensor, so a larger one is a chunk
    alone. update_chunk 0: the largest tensor."""
    if not float32_update(run):
        return 0
    # the device the estimate is for: a CPU's where the run names one, else a GPU's
    chunk = update_chunk(run.train, "cpu" if run.device == "cpu" else "cuda")
    largest = max([*sizes, *alone], default=0)
    if not chunk:
        return 8 * largest
    together = max(sizes, default=0) if run.memory.layerwise else sum(sizes)
    at_once = max(min(chunk, together), *alone, max(sizes, default=0) if whole else 0)
    return 8 * at_once


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


def int8_grad_bytes(shapes: Shapes, is_int8: Callable[[str, tuple[int, ...]], bool],
                    run: RunConfig, steps: Steps) -> int:
    """Gradients where every update runs inside backward (INT8 layers, `is_int8` by name and
    shape): an INT8 layer's G is float32 whatever the precision, the others' at the run's
    width; without accumulation one at a time."""
    int8 = [numel(s) for n, s in shapes.items() if is_int8(n, tuple(s))]
    floats = [numel(s) for n, s in shapes.items() if not is_int8(n, tuple(s))]
    return grad_bytes_of(floats, True, steps.accumulation, widths(run).grad, int8)


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
    tensor, this rank's shard: what this process holds; of a tensor subclass that stores
    other tensors (torchao's quantized states), those."""
    if isinstance(obj, torch.Tensor):
        obj = Rows(obj).local
        if hasattr(obj, "__tensor_flatten__"):  # a quantized state (torchao's): its parts
            return tensor_bytes([getattr(obj, name) for name in obj.__tensor_flatten__()[0]])
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0
