"""A rank's peak under FSDP2 (`train.parallel: fsdp`; hsdp within its shard group, W then
the group's ranks: the replicas all-reduce the reduced shard in place) from shapes alone.

Rank 0 holds the largest share: ceil(m / W) rows of every tensor, its states as the method keeps
them (`Memory.estimate_sharded`). Beside that share, FSDP2 holds whole tensors for a while, in
the compute dtype (bf16 under bf16-mixed and bf16-true, else fp32):
- the root's weights (embeddings, final norm, head) from the start of forward to the end of
  backward (the root is not resharded after forward);
- one decoder layer's weights while it runs, two in backward (the next one is prefetched), and
  that layer's whole gradients, copied into a reduce-scatter buffer in the reduce dtype;
- with accumulation, every whole gradient between micro-batches: nothing is reduced until the
  last one (`set_requires_gradient_sync(False)`);
- at the end of backward, the root's reduce-scatter buffer beside its largest whole gradient.
The peak is the largest of: the loss of a micro-batch (the activation model's `start`, plus the
gathered root and any accumulated whole gradients), the first layer's backward (`bottom`, the
gathered root, the head's whole gradient, two gathered layers and one's gradients twice) and
the root's reduce-scatter. Measured against FSDP's own memory tracker on CPU: tests/cost/
test_sharded.py and docs/scale-out.md.
"""

from __future__ import annotations

from harness.config import RunConfig
from harness.cost.activations import Activations, targets, trains_norms
from harness.methods.memory import Memory, MemoryEstimate, Shapes, numel, row_share
from harness.methods.surgery import is_target
from harness.methods.widths import widths
from harness.models import head_shape

REDUCE_WIDTH = 4  # gradients are reduced in float32 under bf16-mixed (harness/distributed/fsdp.py)


def _widths(run: RunConfig) -> tuple[int, int]:
    """Bytes an element of a gathered weight and of a whole gradient."""
    if run.train.precision == "32-true":
        return 4, 4
    return 2, 2  # bf16-mixed gathers and differentiates in bf16; bf16-true holds bf16


def _layer_numel(shapes: Shapes, memory: Memory) -> int:
    """One decoder layer's elements as it runs: a factored linear's two rank-r factors."""
    rank = getattr(memory.config, "rank", 0)
    total = 0
    for name, shape in shapes.items():
        if ".layers.0." not in name:
            continue
        module = name.rpartition(".")[0]
        own = len(shape) == 2 and is_target(module, targets(memory))
        if own and memory.linears == "factored":
            total += rank * sum(shape)
        else:
            total += numel(shape) + (rank * sum(shape) if own and memory.linears == "adapter"
                                     else 0)
    return total


def fsdp_peak(shard: MemoryEstimate, whole: MemoryEstimate, acts: Activations, run: RunConfig,
              shapes: Shapes, memory: Memory, world: int) -> int:
    """Rank 0's peak: `shard` is its share (`estimate_sharded`), `whole` the one-process
    estimate (for the whole gradients accumulation keeps)."""
    gather, grad = _widths(run)
    reduce = REDUCE_WIDTH if run.train.precision == "bf16-mixed" else grad
    root = {n: s for n, s in shapes.items() if ".layers." not in n}
    trained_root = list(root.values()) if trains_norms(memory) else []
    gathered_root = gather * sum(map(numel, root.values()))
    layer = _layer_numel(shapes, memory)
    static = shard.weight_bytes + shard.optimizer_state_bytes + shard.extra_bytes + acts.workspace
    # the whole gradients accumulation keeps, at the width FSDP differentiates in (bf16-mixed:
    # bf16, where the one-process estimate counts float32)
    accumulated = whole.grad_bytes * grad // widths(run).grad if acts.micro_batches > 1 else 0
    loss = acts.start + accumulated
    head = grad * numel(head_shape(shapes)) if trained_root else 0
    first_layer = acts.bottom + head + 2 * gather * layer + (grad + reduce) * layer
    padded = sum(world * numel(row_share(s, world)) for s in trained_root)
    root_reduce = shard.grad_bytes + reduce * padded + grad * max(map(numel, trained_root),
                                                                  default=0)
    return static + gathered_root + max(loss, first_layer, root_reduce)
