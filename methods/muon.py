"""Muon (Jordan et al., 2024; Liu et al., 2025, "Muon is Scalable for LLM Training"): SGD momentum
whose update is orthogonalized by a Newton–Schulz iteration, one state (the momentum) per hidden
matrix, half of Adam's. Moonlight's split: every 2-D weight but the embeddings and the head takes
Muon; those and the vectors (norms, biases) take AdamW.

The Muon arithmetic is torch's own (`torch.optim.Muon`: its momentum, Nesterov form,
`_zeropower_via_newtonschulz` and `_adjust_lr`), applied per parameter here rather than through
torch's class, because that class cannot do three things the harness composes with every
method: keep float32 momentum for a bfloat16 weight (bf16-true's `state_dtype`), add the update
with stochastic rounding or Kahan compensation, and orthogonalize a matrix FSDP has split by
rows. Under fsdp each rank computes its rows of the momentum, all-gathers the update matrix
(one matrix at a time), runs the iteration on the whole of it, and keeps its rows: every rank
does the whole iteration, so its flops are not divided by the world size. The tests check the
update against `torch.optim.Muon` and the Moonlight example's optimizer, step for step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

# Private to torch, but they are the arithmetic of its public torch.optim.Muon (module docstring).
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.methods.full import AdamConfig, adamw
from harness.modifiers.compensation import ParamwiseOptimizer, add_update, own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig

NOT_HIDDEN = ("embed_tokens", "lm_head")  # Moonlight's example: 2-D, but trained by AdamW
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) defaults
NS_EPS = 1e-7


class MuonConfig(AdamConfig):
    momentum: float = Field(0.95, ge=0, lt=1, description="μ: the momentum's decay")
    nesterov: bool = Field(True, description="the update is g + μ·buffer, not the buffer")
    ns_steps: int = Field(5, ge=1, lt=100, description="Newton–Schulz iterations")
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw", description="original: lr·√max(1, m/n) (Keller Jordan's); "
        "match_rms_adamw: lr·0.2·√max(m, n) (Moonlight's: AdamW's LR and decay carry over)")
    muon_lr: float | None = Field(None, gt=0, description="the hidden matrices' LR (train.lr)")
    muon_weight_decay: float | None = Field(
        None, ge=0, description="the hidden matrices' decay (train.weight_decay)")
    adamw_lr: float | None = Field(
        None, gt=0, description="embeddings', head's and vectors' LR (train.lr)")
    adamw_weight_decay: float | None = Field(
        None, ge=0, description="embeddings' and head's decay (train.weight_decay)")
    decay_vectors: bool = Field(
        False, description="vectors (norms) take adamw_weight_decay too (Moonlight's example)")


def is_hidden(name: str, shape: Iterable[int]) -> bool:
    """Whether Muon trains the parameter `name`: a matrix that is not an embedding or the head."""
    return len(tuple(shape)) == 2 and not any(k in name for k in NOT_HIDDEN)


class MuonOptimizer(ParamwiseOptimizer):
    """Muon over whole or row-sharded matrices: momentum in `state_dtype` (None: the weight's),
    the update added with `compensation` (bf16-true)."""

    def __init__(self, params: Iterable[Any], *, lr: float, momentum: float, nesterov: bool,
                 ns_steps: int, adjust_lr_fn: str, state_dtype: torch.dtype | None = None,
                 compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "weight_decay": 0.0, "momentum": momentum,
                                  "nesterov": nesterov, "ns_steps": ns_steps,
                                  "adjust_lr_fn": adjust_lr_fn})
        self.dtype, self.compensation = state_dtype, compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        st, mu = self.state[p], group["momentum"]
        if not st:  # placed as the weight is: under fsdp, this rank's rows of a DTensor
            st["momentum_buffer"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
        rows = Rows(p)
        w, g = rows.local, Rows(p.grad).local.float()
        buf = Rows(st["momentum_buffer"]).local
        m = buf.float().lerp_(g, 1 - mu)  # torch's buffer: μ·B + (1 - μ)·g; in place at fp32
        if m is not buf:  # a float32 buffer's `.float()` is itself: no copy onto itself
            buf.copy_(m)
        update = g.lerp(m, mu) if group["nesterov"] else m
        whole = rows.gather(update)  # gathered when sharded: the iteration's input
        ortho = _zeropower_via_newtonschulz(whole, NS_COEFFICIENTS, group["ns_steps"], NS_EPS)
        ortho = rows.mine(ortho)
        lr, wd = group["lr"], group["weight_decay"]
        adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
        if w.dtype != torch.bfloat16 or self.compensation == "none":
            w.mul_(1 - lr * wd)  # torch's order: decay, then the orthogonal update
            w.add_(ortho, alpha=-adjusted)
            return
        add_update(w, ortho.float().mul_(-adjusted), self.compensation, st, lr * wd)


class Chain(torch.optim.Optimizer):
    """Optimizers over disjoint groups, stepped, zeroed, saved and loaded as one: their groups,
    in order, are what the LR scheduler, the loss scaler and the host offload see."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.inner = optimizers
        self.defaults = {}
        # What torch's Optimizer.__init__ makes besides groups and states (the inner ones'):
        # the hook tables that its memory tracker and profiler register into, called by step.
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                     "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self.inner for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        return {p: s for opt in self.inner for p, s in opt.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None if closure is None else closure()
        for opt in self.inner:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.inner:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [opt.state_dict() for opt in self.inner]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, sd in zip(self.inner, state_dict["inner"], strict=True):
            opt.load_state_dict(sd)


@register("muon")
class Muon(Method):
    summary = "Muon: orthogonalized momentum on hidden matrices, AdamW on the rest (Moonlight)"
    Config = MuonConfig

    def check(self, run: RunConfig) -> Terms:
        # fsdp: each hidden matrix's update is gathered for the iteration (module docstring)
        return Terms(refusal=unpaged(run, "momentum", one=True), fsdp=None)

    def groups(self, model: nn.Module, run: RunConfig) -> Groups:
        """Hidden matrices (Muon), embeddings and head (AdamW, decayed), vectors (AdamW,
        decayed only with `decay_vectors`); each group's LR and decay from the settings. Muon's
        group first: the chain's groups are then these, in this order."""
        c, t = self.config, run.train
        adamw_wd = t.weight_decay if c.adamw_weight_decay is None else c.adamw_weight_decay
        muon_wd = t.weight_decay if c.muon_weight_decay is None else c.muon_weight_decay
        adamw_lr = c.adamw_lr or t.lr
        hidden, matrices, vectors = [], [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                kind = hidden if is_hidden(name, p.shape) else matrices if p.dim() >= 2 \
                    else vectors
                kind.append(p)
        return [
            {"params": hidden, "muon": True, "lr": c.muon_lr or t.lr, "weight_decay": muon_wd},
            {"params": matrices, "muon": False, "lr": adamw_lr, "weight_decay": adamw_wd},
            {"params": vectors, "muon": False, "lr": adamw_lr,
             "weight_decay": adamw_wd if c.decay_vectors else 0.0},
        ]

    def optimizer(self, groups: Groups, run: RunConfig) -> torch.optim.Optimizer:
        """Muon on the `muon` groups, the harness's AdamW (full's: fused, or bf16-true's) on
        the others; one of them alone when the groups are one parameter's (layer-wise)."""
        c = self.config
        hidden = [g for g in groups if g["muon"]]
        rest = [g for g in groups if not g["muon"]]
        optimizers = []
        if hidden:
            optimizers.append(MuonOptimizer(
                hidden, lr=run.train.lr, momentum=c.momentum, nesterov=c.nesterov,
                ns_steps=c.ns_steps, adjust_lr_fn=c.adjust_lr_fn,
                **own_optimizer_kwargs(run.train)))
        if rest:
            optimizers.append(adamw(rest, run, c))
        return optimizers[0] if len(optimizers) == 1 else Chain(optimizers)
