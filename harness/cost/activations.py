"""Activation memory of a pretraining step from shapes alone, and with it the step's peak.

Counted on llama_* (torch 2.13, transformers' LLaMA, saved-tensor hooks), per token and decoder
layer, d hidden, i intermediate, h heads, a the activation's bytes (4 fp32, 2 under autocast):
- each RMSNorm keeps its fp32 input, the normalised fp32 input and the 4-byte inverse root;
- attention keeps q, k, v and the output (a·d each; in general q and the output heads·head_dim
  wide, k and v kv_heads·head_dim under grouped-query attention unless a sliding window's mask
  makes transformers repeat them to every head) and flash attention's fp32 log-sum-exp
  (4 per head); its linears keep their input: one shared fp32 norm output, but under autocast
  a 2-byte copy per linear that reads it (q, k and v: three);
- the MLP keeps gate, silu(gate), up and their product (a·i each), and its input as above
  (gate and up: two copies under autocast);
- autocast also keeps a 2-byte copy of every float linear weight until that linear's backward;
- the head and the loss (harness/train/lm_loss.py, `head_bytes`) keep the final norm's three,
  the lm_head input, the logits in their dtype (aV a token, the model's own tensor: no sliced
  copy, no fp32 one) and a 4-byte log-sum-exp; at the start of backward the logits' gradient
  (aV) lives beside them, with the fp32 work on a piece of the tokens (`loss_rows`). With
  `loss_chunk` c no logits are kept, only the hidden state: a chunk's logits, their fp32 work
  and gradient (about 10cV bytes under bf16) and the head's gradients are the start's; liger's
  fused loss keeps none either and makes the hidden state's and the head's gradients in
  forward.
That is 40d + 16i + 4h + 8 bytes a token and layer in fp32 and 34d + 8i + 4h + 8 under
autocast. Under bf16-true (the whole model bf16, methods/widths.py) there are no autocast
copies, each norm keeps a fp32 copy of its bf16 input, the inverse root and its bf16 output,
everything else a layer keeps is 2 bytes but the log-sum-exp: 24d + 8i + 4h + 8; the residual
stream, its gradients and RoPE's cos/sin are 2 bytes too, the loss's log-sum-exp stays fp32.
Forward peaks while the loss is computed: all of it, the weight copies autocast caches but
nothing saved, and the loss's pieces, fewer bytes than the start of backward's. A method
changes the linears (`Memory.linears`); recompute keeps only a recomputed module's input
and adds one layer's activations back while that layer's backward runs; offload moves the
offloaded modules' saved tensors of all but the last layer off a GPU and brings one layer
back ahead of backward. A step's peak is then the method's weights,
states and extras plus the largest of: the start of backward, the last layer's and the first
layer's backward (with every gradient above it), and all gradients with the update's
temporaries (`Memory.update_bytes`: bf16-true's float32 updates, of one chunk of
train.update_chunk elements or one weight); gradients of earlier
micro-batches live through later ones. Checked against whole steps: tests/
test_activations.py and `harness bench memory` (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.config import RunConfig
from harness.methods.memory import Memory, MemoryEstimate, Shapes, numel
from harness.methods.surgery import TARGETS, is_target
from harness.methods.widths import Widths, widths
from harness.models import architecture, head_shape
from harness.modifiers.multi_tensor import piece

# cuBLAS workspaces torch allocates on a CUDA device and keeps for the process: one per thread
# that runs matmuls (the forward's and autograd's backward thread), 32 MiB each on Hopper as
# torch 2.11 sizes them (8.125 MiB on older GPUs: there this overstates by 48 MiB). They stay
# allocated after every run, so every steady-step peak on the device includes them.
CUBLAS_WORKSPACES = 2 * 32 * 2**20

def loss_rows(vocab: int, device: str) -> int:
    """Tokens a piece of the pretraining loss's float32 work on logits takes on `device` (a
    device type; harness/train/lm_loss.py): about the device's `piece` of elements."""
    return max(1, piece(device) // vocab)

KIND_LINEARS = {"attention": TARGETS[:4], "mlp": TARGETS[4:], "norm": ()}


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    seq_len: int
    batch: int  # sequences per forward (the micro-batch)
    head_dim: int
    kv_width: int  # k's and v's, as attention saves them

    @property
    def q_width(self) -> int:
        """The queries' width, and the attention output's."""
        return self.heads * self.head_dim

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def dims(run: RunConfig, shapes: Shapes) -> Dims:
    """Under grouped-query attention sdpa keeps k and v kv_heads wide when it gets no mask
    (enable_gqa); with a sliding window's mask transformers repeats them to every head first."""
    a = architecture(run.model, run.model_options)
    kv_heads = a.heads if a.windowed(run.task.seq_len) else a.kv_heads
    return Dims(a.hidden, a.intermediate, a.layers, a.heads, head_shape(shapes)[0],
                run.task.seq_len, run.train.batch_size, a.head_dim, kv_heads * a.head_dim)


def norm_bytes(d: Dims, w: Widths, memory: Memory) -> int:
    """One RMSNorm, a token: its fp32 input (under bf16-true a fp32 copy of the bf16 one), the
    4-byte inverse root, and the normalised input in the model's dtype, kept for the weight's
    gradient only."""
    return 4 * d.hidden + 4 + (w.weight * d.hidden if trains_norms(memory) else 0)


def kind_bytes(d: Dims, kind: str, w: Widths, memory: Memory) -> int:
    """Bytes a token that one layer's `kind` module(s) save for backward."""
    a, autocast = w.activation, w.autocast
    if kind == "norm":
        return 2 * norm_bytes(d, w, memory)
    linears = [n for n in KIND_LINEARS[kind] if is_target(n, targets(memory))]
    rank = getattr(memory.config, "rank", 0) if memory.linears in ("adapter", "factored") else 0
    readers = 3 if kind == "attention" else 2  # linears reading the same input
    shared = w.weight * d.hidden  # the norm's output, in the model's dtype
    inputs = readers * 2 * d.hidden if autocast and memory.linears != "quantized" else shared
    if autocast and memory.linears == "adapter" and "o_proj" in linears:
        inputs += 2 * d.q_width  # the adapter's copy of o_proj's input (attention's output)
    saved = inputs + rank * a * len(linears)
    if kind == "attention":  # q, k, v and the output
        return saved + 2 * a * (d.q_width + d.kv_width) + 4 * d.heads
    return saved + 4 * a * d.intermediate


def trains_norms(memory: Memory) -> bool:
    return getattr(memory.config, "train_non_targets", True)


def targets(memory: Memory) -> tuple[str, ...]:
    return tuple(getattr(memory.config, "target_modules", TARGETS))


def weight_copies(shapes: Shapes, memory: Memory, kind: str | None) -> int:
    """Autocast's 2-byte copies of one layer's float linear weights of `kind` (None: lm_head's):
    quantized and factored linears have none (a factor's own copy is rank-sized: ignored)."""
    if kind is None:
        return 2 * numel(head_shape(shapes))
    if memory.linears in ("quantized", "factored"):
        return 0
    names = KIND_LINEARS[kind]
    layer = [s for n, s in shapes.items()
             if ".layers.0." in n and is_target(n.rpartition(".")[0], names)]
    return 2 * sum(map(numel, layer))


@dataclass(frozen=True)
class Activations:
    """Bytes beyond the static ones at the moments a step's peak can fall on."""

    start: int  # the start of backward: everything saved plus the loss's gradients
    top: int  # the last layer's backward, its activations recomputed or fetched back
    bottom: int  # the first layer's backward; gradients of the layers above come on top
    micro_batches: int  # per step on one process: past one, earlier ones' gradients stay
    workspace: int = 0  # the device's matmul library's own buffers, there from the first step
    update: int = 0  # one weight's update's own temporaries, beside the gradients (the step)


def activations(run: RunConfig, shapes: Shapes, memory: Memory, device: str) -> Activations:
    """`device` "cpu" keeps offloaded tensors in the same memory (nothing is saved there)."""
    d, m = dims(run, shapes), run.memory
    w = widths(run)
    autocast, r, t = w.autocast, w.weight, d.tokens  # r: the residual stream's
    kinds = ("norm", "attention", "mlp")
    saves = {k: kind_bytes(d, k, w, memory) * t for k in kinds}
    copies = {k: weight_copies(shapes, memory, k) if autocast else 0 for k in kinds}
    recomputed = kinds if m.recompute == "full" else tuple(m.recomputed)
    inputs = {"norm": 2, "attention": 1, "mlp": 1}  # inputs a recomputed module keeps
    if m.recompute == "full":
        kept = {"input": r * d.hidden * t}  # the layer's
    else:
        kept = {k: inputs[k] * r * d.hidden * t if k in recomputed else saves[k] + copies[k]
                for k in kinds}  # fmt: skip
    layer = sum(kept.values())
    full = sum(saves.values()) + sum(copies.values())  # a layer while its backward runs
    offloaded = sum(kept[k] for k in m.offloaded) if device != "cpu" else 0
    rope = 2 * d.seq_len * d.head_dim * r  # cos and sin, in the model's dtype
    layers = d.layers * layer - (d.layers - 1) * offloaded + rope
    head, loss = head_bytes(run, d, w, memory, shapes, device)
    # the autocast cache holds trained float weights' copies through forward, saved or not
    cached = sum(copies[k] for k in recomputed) * d.layers if memory.linears == "float" else 0
    grads = 2 * r * d.hidden * t  # the hidden state's gradient, and its residual branch's
    return Activations(
        start=layers + head + loss + cached,
        top=layers + offloaded + full - layer + grads,
        bottom=full + rope + grads,
        micro_batches=memory.steps.accumulation,
        workspace=CUBLAS_WORKSPACES if device != "cpu" else 0,
        update=memory.update_bytes(shapes, run),
    )


def head_bytes(run: RunConfig, d: Dims, w: Widths, memory: Memory, shapes: Shapes,
               device: str) -> tuple[int, int]:
    """The final norm's, the head's and the loss's bytes (harness/train/lm_loss.py): those kept
    through forward, and those beside them at the start of backward, its peak. The float32 work
    on logits (a copy of non-float32 ones, then their exp) runs a piece of the tokens at a
    time: `loss_rows` of them, or a `loss_chunk` of them, whose logits are made again."""
    a, t, v, h = w.activation, d.tokens, d.vocab, d.hidden
    norm = norm_bytes(d, w, memory) * t
    fp32 = 4 if a == 4 else 8  # bytes an element of the float32 work on a piece's logits
    cast = 2 * v * h if w.autocast else 0  # the weight in autocast's dtype, for its matmuls
    if run.model_options.kernels == "liger":
        # its forward makes the hidden state's and the weight's gradients, beside one chunk's
        # logits (its chunks hold at most about twice the hidden state's elements)
        return norm + w.weight * h * t, w.weight * (h * t + v * h) + cast + 2 * a * h * t
    chunk = run.train.loss_chunk
    if not chunk:  # the head's input and the logits kept, their gradient at the start
        copies = weight_copies(shapes, memory, None) if w.autocast else 0
        pieces = fp32 * v * min(t, loss_rows(v, device))
        return norm + (a * h + a * v + 4) * t + copies, a * v * t + pieces
    c = min(chunk, t)
    # beside the hidden state's and the weight's (float32) gradients, the larger of a chunk's
    # logits with their float32 work, and its logits and their gradient with the chunk's share
    # of the weight's gradient (a float32 copy of it where it is not float32, as it is added)
    work = max((a + fp32) * v * c, 2 * a * v * c + a * v * h + (4 * v * h if a != 4 else 0))
    return norm + (w.weight * h + 4) * t, w.weight * h * t + 4 * v * h + cast + work


def tied(shapes: Shapes) -> bool:
    return "lm_head.weight" not in shapes


def peak_bytes(estimate: MemoryEstimate, acts: Activations, run: RunConfig,
               shapes: Shapes) -> int:
    """The step's peak: static bytes plus the largest of the moments, each with the gradients
    alive then. Without layer-wise updates the first layer's backward has every gradient but
    the embedding's; gradients of earlier micro-batches are there throughout."""
    static = (estimate.weight_bytes + estimate.optimizer_state_bytes + estimate.extra_bytes
              + acts.workspace)
    grads = estimate.grad_bytes
    if run.memory.layerwise:  # one gradient at a time (`grad_bytes`): never beside the rest
        return static + max(acts.start, acts.top, acts.bottom, grads + acts.update)
    total = sum(map(numel, shapes.values()))
    # a tied embedding is the head, whose gradient comes first
    embedding = sum(numel(s) for n, s in shapes.items() if "embed" in n and not tied(shapes))
    above = grads * (total - embedding) // total  # the first layer's own come as it runs
    earlier = grads if acts.micro_batches > 1 else 0
    return static + max(earlier + max(acts.start, acts.top), earlier + acts.bottom + above,
                        grads + acts.update)
