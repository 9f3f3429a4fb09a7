"""Muon (Jordan et al., 2024; Liu et al., 2025, "Muon is Scalable for LLM Training"): SGD momentum
whose update is orthogonalized by a Newton–Schulz iteration, one state (the momentum) per hidden
matrix, half of Adam's. Moonlight's split: every 2-D weight but the embeddings and the head takes
Muon; those and the vectors (norms, biases) take AdamW.

The Muon arithmetic is torch's own (`torch.optim.Muon`: its momentum, Nesterov form,
`_zeropower_via_newtonschulz` and `_adjust_lr`), applied per parameter here rather than through
torch's class, because that class cannot do three things the harness composes with every
method: keep float32 momentum for a bfloat16 weight (bf16-true's `state_dtype`), add the update
with stochastic rounding or Kahan compensation, and orthogonalize a matrix FSDP has split by
rows. Under fsdp each rank computes its rows of the momentum and of the update; the matrices
of a step are shared out among the ranks, balanced by the iteration's flops
(harness/distributed/owners.py), each goes whole to its owner (one all-to-all for all of them),
the owner runs the iteration, and each rank gets its rows of the result back (a second
all-to-all): a rank orthogonalizes about 1/W of the matrices, on the same input as one process.
Layer-wise, a step is one matrix, whose owner goes round the ranks. The tests check the update
against `torch.optim.Muon` and the Moonlight example's optimizer, step for step.
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

from harness.config.tuning import tunable
from harness.distributed.rows import Rows
from harness.methods.base import Groups, Method, Terms, register, unpaged
from harness.methods.full import AdamConfig, adamw
from harness.modifiers.compensation import ParamwiseOptimizer, add_update, own_optimizer_kwargs

if TYPE_CHECKING:
    from harness.config import RunConfig

NOT_HIDDEN = ("embed_tokens", "lm_head")  # Moonlight's example: 2-D, but trained by AdamW
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) defaults
NS_EPS = 1e-7
# torch's iteration casts its input to this and returns it so: sharded, both trips carry it,
# the same values as the float32 update's cast (half its bytes)
NS_DTYPE = torch.bfloat16


class MuonConfig(AdamConfig):
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="moment decay rates (the AdamW-trained parameters')")
    momentum: float = tunable(0.95, values=[0.9, 0.95, 0.98], ge=0, lt=1,
                              description="μ: the momentum's decay",
                              source="Muon's momentum, which arXiv 2509.02046 tunes")
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

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Each group's matrices with a gradient: momentum, orthogonalized update, step."""
        loss = None if closure is None else closure()
        with torch.no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params and Rows(params[0]).sharded and Rows.workers()[0] > 1:
                    self._spread(group, params)
                    continue
                for p in params:  # one matrix's temporaries at a time
                    self._apply(group, p, newton_schulz(self._momentum(group, p),
                                                        group["ns_steps"]))
        return loss

    def _spread(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """fsdp: every matrix's update goes whole to the rank that orthogonalizes it
        (owners.py: balanced by `ns_flops`), and each rank gets its rows of the result back;
        this rank's rows of every update, and the wholes it owns, are held at once."""
        updates = [self._momentum(group, p) for p in params]
        steps = group["ns_steps"]
        world, _ = Rows.workers()
        who = Rows.share("newton_schulz", [ns_flops(p.shape, steps) for p in params], world)
        parts = [Rows.Part(tuple(p.shape), o) for p, o in zip(params, who, strict=True)]
        device = updates[0].device
        wholes = Rows.to_owners([u.to(NS_DTYPE) for u in updates], parts)
        del updates
        results = [None if x is None else newton_schulz(x, steps) for x in wholes]
        del wholes
        for p, o in zip(params, Rows.from_owners(results, parts, NS_DTYPE, device),
                        strict=True):
            self._apply(group, p, o)

    def _momentum(self, group: dict[str, Any], p: Tensor) -> Tensor:
        """The momentum updated in place, and the update Newton–Schulz takes (this rank's
        rows, float32)."""
        st, mu = self.state[p], group["momentum"]
        if not st:  # placed as the weight is: under fsdp, this rank's rows of a DTensor
            st["momentum_buffer"] = torch.zeros_like(p, dtype=self.dtype or p.dtype)
        g = Rows(p.grad).local.float()
        buf = Rows(st["momentum_buffer"]).local
        m = buf.float().lerp_(g, 1 - mu)  # torch's buffer: μ·B + (1 - μ)·g; in place at fp32
        if m is not buf:  # a float32 buffer's `.float()` is itself: no copy onto itself
            buf.copy_(m)
        return g.lerp(m, mu) if group["nesterov"] else m

    def _apply(self, group: dict[str, Any], p: Tensor, ortho: Tensor) -> None:
        """W ← (1 − lr·wd)·W − adjusted lr · the orthogonalized update (this rank's rows)."""
        self._add(group, p, ortho, _adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))

    def _add(self, group: dict[str, Any], p: Tensor, update: Tensor, step_lr: float) -> None:
        """W ← (1 − lr·wd)·W − step_lr · update (this rank's rows), compensated under bf16-true."""
        w = Rows(p).local
        lr, wd = group["lr"], group["weight_decay"]
        if w.dtype != torch.bfloat16 or self.compensation == "none":
            w.mul_(1 - lr * wd)  # torch's order: decay, then the orthogonal update
            w.add_(update, alpha=-step_lr)
            return
        add_update(w, update.float().mul_(-step_lr), self.compensation, self.state[p], lr * wd)


def ns_flops(shape: Iterable[int], steps: int) -> int:
    """Multiply-adds ×2 of `steps` quintic Newton–Schulz iterations on a `shape` matrix
    (torch's: on the wide orientation, a×b with a ≤ b): A = XXᵀ (2a²b), B = bA + cA² (2a³),
    X = aX + BX (2a²b) each."""
    a, b = sorted(shape)
    return steps * (4 * a * a * b + 2 * a**3)


def newton_schulz(update: Tensor, steps: int) -> Tensor:
    """torch.optim.Muon's orthogonalization of a whole update matrix."""
    return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, steps, NS_EPS)


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
        # fsdp: each hidden matrix's update goes whole to one rank (module docstring)
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
        hidden = [g for g in groups if g["muon"]]
        rest = [g for g in groups if not g["muon"]]
        optimizers = [self._orthogonal(hidden, run)] if hidden else []
        if rest:
            optimizers.append(adamw(rest, run, self.config))
        return optimizers[0] if len(optimizers) == 1 else Chain(optimizers)

    def _orthogonal(self, hidden: Groups, run: RunConfig) -> MuonOptimizer:
        """The optimizer of the hidden matrices (a variant's own: NorMuon)."""
        c = self.config
        return MuonOptimizer(hidden, lr=run.train.lr, momentum=c.momentum, nesterov=c.nesterov,
                             ns_steps=c.ns_steps, adjust_lr_fn=c.adjust_lr_fn,
                             **own_optimizer_kwargs(run.train))
