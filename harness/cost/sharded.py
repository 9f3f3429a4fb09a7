"""A rank's peak under FSDP2 (`train.parallel: fsdp`; hsdp within its shard group, W then
the group's ranks: the replicas all-reduce the reduced shard in place) from shapes alone.

Rank 0 holds the largest share: ceil(m / W) rows of every tensor, its states as the method keeps
them (`Memory.estimate_sharded`). Beside that share, FSDP2 holds whole tensors for a while, in
the weights' dtype (bf16 under bf16-true, else fp32: bf16-mixed autocasts gathered fp32):
- the root's weights (embeddings, final norm, head) from the start of forward to the end of
  backward (the root is not resharded after forward);
- one decoder layer's weights while it runs, two in backward (the next one is prefetched), and
  that layer's whole gradients, copied into a reduce-scatter buffer;
- with accumulation, the reduced gradient shards between micro-batches (`train.fsdp_reduce:
  every`), or every whole gradient (`last`: nothing is reduced until the last micro-batch);
- at the end of backward, the root's reduce-scatter buffer beside its largest whole gradient
  (with `every`, from the second micro-batch on, beside the reduced shard too, until it is
  added to the one accumulating).
The peak is the largest of: the loss of a micro-batch (the activation model's `start`, plus the
gathered root and what accumulation keeps), the first layer's backward (`bottom`, the
gathered root, the head's whole gradient, two gathered layers and one's gradients twice, and
the accumulated shards) and
the root's reduce-scatter. Measured against FSDP's own memory tracker on CPU: tests/cost/
test_sharded.py and docs/scale-out.md.
"""

from __future__ import annotations

from harness.config import RunConfig
from harness.cost.activations import Activations, targets, trains_norms
from harness.methods.memory import Memory, MemoryEstimate, Shapes, numel, row_share
from harness.methods.surgery import is_target
from harness.models import head_shape


def _width(run: RunConfig) -> int:
    """Bytes an element of a gathered weight, of a whole gradient and of its reduce-scatter
    copy: bf16-true's bfloat16, else float32 (bf16-mixed gathers float32 and autocasts)."""
    return 2 if run.train.precision == "bf16-true" else 4


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
    estimate (for the whole gradients accumulation keeps under `fsdp_reduce: last`)."""
    width = _width(run)  # a gathered weight's, a whole gradient's, its reduce-scatter copy's
    root = {n: s for n, s in shapes.items() if ".layers." not in n}
    trained_root = list(root.values()) if trains_norms(memory) else []
    gathered_root = width * sum(map(numel, root.values()))
    layer = _layer_numel(shapes, memory)
    static = shard.weight_bytes + shard.optimizer_state_bytes + shard.extra_bytes + acts.workspace
    # what accumulation keeps between micro-batches: this rank's reduced shards, or (`last`)
    # the whole gradients; the shards are there through each later backward too, where each
    # reduce-scatter's output is a new shard until it is added to them
    last = run.train.fsdp_reduce == "last"
    accumulated = 0 if acts.micro_batches == 1 else whole.grad_bytes if last else shard.grad_bytes
    into = 0 if acts.micro_batches == 1 or last else 1  # a later micro-batch's output
    loss = acts.start + accumulated
    head = width * numel(head_shape(shapes)) if trained_root else 0
    first_layer = (acts.bottom + head + 4 * width * layer
                   + into * (accumulated + width * layer // world))
    padded = sum(world * numel(row_share(s, world)) for s in trained_root)
    root_reduce = (shard.grad_bytes + width * (padded + max(map(numel, trained_root), default=0))
                   + into * width * padded // world)
    return static + gathered_root + max(loss, first_layer, root_reduce)
