"""Adam-mini (Zhang et al., 2024, "Adam-mini: Use Fewer Learning Rates To Gain More"): Adam with
one second moment per block of a weight instead of one per element, the first moment full-size.

The partition is the reference package's (`adam-mini` 1.1.1, `Adam_mini.step`), read from the
parameter's name: query and key one block per head, value, attention output, MLP, embeddings
and lm_head one per output row (a neuron, a token), biases one per element (plain Adam), every
other tensor (norms) one for the whole tensor. An m×n weight keeps mn + blocks state values.

Our own optimizer, not the package's: the package needs parameter names in its groups (ours
get groups: one parameter's when layer-wise), calls `dist.all_gather`/`all_reduce` whenever
more than one CUDA device is visible (without a process group it fails; our gradients are
already averaged over ranks before the step, so no collective is needed; under fsdp a head's
or a norm's block may span shards, and only its sum of squares is all-reduced), and keeps its
states in the weight's dtype with no update compensation under bf16-true. The tests check it
against the package step for step (tests/methods/test_adam_mini.py; docs/fidelity.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.methods.full import AdamConfig
from harness.modifiers.compensation import (
    ParamwiseOptimizer,
    add_update,
    keep_rounded,
    own_optimizer_kwargs,
)

if TYPE_CHECKING:
    from harness.config import RunConfig

# The reference's name keywords (`Adam_mini.__init__`), matched as substrings of the lowercased
# parameter name, in its order: bias first, then query/key, then the per-row kinds.
QUERY_KEY = ("k_proj", "q_proj", "wq", "wk", "query", "key")
PER_ROW = ("embed", "embd", "wte", "lm_head", "output", "final_layer", "v_proj", "wv", "value",
           "o_proj", "wo", "attn.proj", "feed_forward", "linear", "mlp")
KINDS = ("element", "head", "row", "tensor")
# Under fsdp, the second moments every rank holds whole: a head's or a tensor's block may
# span shards (its mean square is then summed over ranks); the others are row shards.
WHOLE = {"element": (), "row": (), "head": ("exp_avg_sq",), "tensor": ("exp_avg_sq",)}


def block_kind(name: str, shape: tuple[int, ...]) -> str:
    """How the reference partitions the parameter `name`: per element (a bias), per head
    (query, key), per output row (value, attention output, MLP, embeddings, lm_head) or one
    block (anything else: norms). Head and row blocks need a matrix."""
    name = name.lower()
    if "bias" in name:
        return "element"
    if len(shape) >= 2 and any(k in name for k in QUERY_KEY):
        return "head"
    if len(shape) >= 2 and any(k in name for k in PER_ROW):
        return "row"
    return "tensor"


def block_count(kind: str, shape: tuple[int, ...], head_dim: int) -> int:
    """Second-moment values of a tensor of `shape` partitioned as `kind` (`head_dim`: rows of
    one attention head)."""
    if kind == "element":
        return math.prod(shape)
    if kind == "head":
        if shape[0] % head_dim:
            raise ValueError(f"{shape[0]} rows are not whole heads of {head_dim} rows")
        return shape[0] // head_dim
    return shape[0] if kind == "row" else 1


class AdamMini(ParamwiseOptimizer):
    """Adam-mini over groups that each name their `block` kind (KINDS) and, for heads,
    `head_dim`. Arithmetic in float32; states in `state_dtype` (None: the weight's dtype);
    the update added by `add_update` with `compensation` (bf16-true). Decoupled weight decay,
    as the reference's `p.mul_(1 - lr * wd)`."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "block": "tensor", "head_dim": 1}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["block"] not in KINDS:
                raise ValueError(f"block {group['block']!r} is not one of {KINDS}")
        self.dtype, self.compensation = state_dtype, compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        (b1, b2), lr, wd, kind = group["betas"], group["lr"], group["weight_decay"], group["block"]
        blocks = block_count(kind, tuple(p.shape), group["head_dim"])
        rows = Rows(p)
        st, w = self.state[p], rows.local  # under fsdp: this rank's rows
        spans = rows.sharded and kind in ("head", "tensor")
        here = w.shape[0] if kind == "row" else blocks  # the blocks this rank's moments hold
        if not st:
            dtype = self.dtype or p.dtype
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(w, dtype=dtype)
            v_shape = w.shape if kind == "element" else (here, 1)
            st["exp_avg_sq"] = torch.zeros(v_shape, dtype=dtype, device=w.device)
        st["step"] += 1
        g = Rows(p.grad).local.float()
        m = st["exp_avg"].float().lerp_(g, 1 - b1)  # the state itself when float32
        keep_rounded(st, {"exp_avg": m})
        if kind == "element":
            square, m_blocks = g * g, m
        elif spans:
            square, of_row = _spanning_mean_square(rows, g, blocks)
            m_blocks = m.reshape(len(of_row), -1)
        else:  # one row of the view per block: its mean square is the block's
            m_blocks = m.reshape(here, -1)
            square = g.reshape(here, -1).square().mean(1, keepdim=True)
        v = st["exp_avg_sq"].float().mul_(b2).add_(square, alpha=1 - b2)
        del g, square  # each float32 temporary goes as soon as it is used: see add_update
        keep_rounded(st, {"exp_avg_sq": v})
        denom = v.sqrt().div_(math.sqrt(1 - b2 ** st["step"])).add_(group["eps"])
        if spans:
            denom = denom[of_row]  # each of this rank's rows by its block's
        update = m_blocks.div(denom).mul_(-lr / (1 - b1 ** st["step"])).reshape(w.shape)
        add_update(w, update, self.compensation, st, lr * wd)

    def state_dict(self) -> dict[str, Any]:
        """Under fsdp, row states placed as row shards, which a checkpoint writes shard by shard."""
        sd = super().state_dict()
        for index, (p, kind) in enumerate(self._kinds()):
            if index in sd["state"]:
                sd["state"][index] = Rows(p).save(sd["state"][index], WHOLE[kind])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p, kind in self._kinds():
            if p in self.state:
                Rows(p).load(self.state[p], WHOLE[kind])

    def _kinds(self) -> list[tuple[Tensor, str]]:
        return [(p, g["block"]) for g in self.param_groups for p in g["params"]]


def _spanning_mean_square(rows: Rows, g: Tensor, blocks: int) -> tuple[Tensor, Tensor]:
    """fsdp, a head's or a tensor's blocks, which a shard's rows may split: each block's
    mean square from every rank's partial sums (an all-reduce of `blocks` values), and the
    block of each of this rank's rows."""
    p, span = rows.tensor, rows.span
    per_block = p.shape[0] // blocks  # rows (a 1-D tensor: elements) of one block
    of_row = torch.arange(span.start, span.stop, device=g.device) // per_block
    sums = torch.zeros(blocks, device=g.device).index_add_(
        0, of_row, g.reshape(len(of_row), -1).square().sum(1))
    rows.sum(sums)
    return (sums / (p.numel() // blocks)).unsqueeze(1), of_row


def head_dim_of(model: nn.Module) -> int:
    """Rows of one attention head, from the model's config (as the reference's dim / n_heads)."""
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@register("adam_mini")
class AdamMiniMethod(Method):
    summary = "Adam-mini: Adam with one second moment per head / output row / tensor"
    Config = AdamConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: row blocks stay on their shard; head and tensor blocks are summed over ranks
        return Terms(refusal=unpaged(run, "per-block second moments"), fsdp=None)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """One group per block kind and decay: matrices decayed, vectors (norms, biases) not."""
        head_dim, wd = head_dim_of(model), run.train.weight_decay
        groups: dict[tuple[str, bool], Groups] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                kind = block_kind(name, tuple(p.shape))
                block_count(kind, tuple(p.shape), head_dim)  # a bad head split fails here
                groups.setdefault((kind, p.dim() >= 2), []).append(p)
        return [{"params": ps, "block": kind, "head_dim": head_dim,
                 "weight_decay": wd if decay else 0.0}
                for (kind, decay), ps in groups.items()]

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        c, kwargs = self.config, own_optimizer_kwargs(run.train)
        return AdamMini(groups, lr=run.train.lr, betas=c.betas, eps=c.eps, **kwargs)
