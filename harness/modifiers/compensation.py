"""bf16-true: how an optimizer's update is added to a bfloat16 weight, for every optimizer of the
harness that computes its update itself (the AdamW below, GaLore's and those built on it).

bfloat16 keeps 8 significant bits: an update smaller than half a unit in the last place of the
weight is lost when the sum is rounded to nearest (`none`, what the GaLore and Q-GaLore
reference code does). `stochastic_rounding` rounds the float32 sum up or down at random, with
the probability that makes the expected result exact. `kahan` keeps, per weight, a bfloat16
buffer of what rounding lost (Kahan summation) and adds it back with the next update; the
buffer lives in the optimizer state (`KAHAN`), so checkpoints keep it and a resume is exact.
Stochastic rounding draws from torch's global generator, which checkpoints keep too."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

KAHAN = "kahan_comp"  # the state key of the compensation buffer (torch-optimi's name)
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def stochastic_round_(out: Tensor, value: Tensor) -> None:
    """`out` (bfloat16) <- float32 `value` rounded to one of its two bfloat16 neighbours, the
    upper one with probability (distance to the lower) / (their gap): random low 16 bits added
    to the float32 pattern, then truncated. Sign-magnitude makes it right for negatives too."""
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    out.copy_(noise.add_(bits).bitwise_and_(-65536).view(torch.float32))  # the sum in place


def add_update(param: Tensor, update: Tensor, mode: str, state: dict[str, Any],
               decay: float = 0.0) -> None:
    """param ← param - decay·param + update, in place, `update` float32 and consumed (its storage
    becomes the sum). A weight that is not bfloat16, or `mode` "none", rounds the float32 sum to
    nearest once; "stochastic_rounding" and "kahan" as the module says (`state`: the weight's
    optimizer state, which holds the Kahan buffer). Every operation here has operands of one
    dtype: a CPU makes a float32 copy of each bfloat16 operand of a mixed one (CUDA does not),
    so the step's temporaries are the same two float32 tensors of the weight's size (`update`
    and one more) on either device (`Method.update_bytes`)."""
    if param.dtype != torch.bfloat16:
        if decay:
            update.add_(param, alpha=-decay)
        param.add_(update)
        return
    weight = param.float()
    if decay:
        update.add_(weight, alpha=-decay)
    total = update.add_(weight)  # the same sum as weight + update: IEEE addition commutes
    del weight
    if mode == "none":
        param.copy_(total)
    elif mode == "stochastic_rounding":
        stochastic_round_(param, total)
    elif mode == "kahan":
        comp = state.get(KAHAN)
        if comp is None:
            comp = state[KAHAN] = torch.zeros_like(param)
        total.add_(comp.float())
        param.copy_(total)  # round to nearest; what that lost goes to the buffer
        comp.copy_(total.sub_(param.float()))
    else:
        raise ValueError(f"unknown update compensation {mode!r}")


def restore_dtypes(optimizer: torch.optim.Optimizer, load: Callable[[dict[str, Any]], None],
                   state_dict: dict[str, Any]) -> None:
    """torch's `load_state_dict` casts every state tensor to its parameter's dtype: put the
    saved tensors back as they were (float32 moments of a bfloat16 weight), so that a resume is
    exact."""
    saved = {i: {k: v for k, v in s.items() if isinstance(v, Tensor)}
             for i, s in state_dict["state"].items()}
    load(state_dict)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        st = optimizer.state.get(p, {})
        for k, v in saved.get(i, {}).items():
            st[k] = v.to(p.device)


class ParamwiseOptimizer(torch.optim.Optimizer):
    """An optimizer that updates each parameter with a gradient on its own (`_update`), in
    float32 arithmetic whatever the weight's dtype, and whose saved states come back in the
    dtype they were saved in."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None if closure is None else closure()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(group, p)
        return loss

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_dtypes(self, super().load_state_dict, state_dict)


class AdamW(ParamwiseOptimizer):
    """AdamW for bf16-true weights: moments in `state_dtype`, each update computed in float32
    and added by `add_update` with `compensation`. Decoupled weight decay, as torch's AdamW."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_dtype: str = "float32",
                 compensation: str = "none") -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.dtype, self.compensation = STATE_DTYPES[state_dtype], compensation

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=self.dtype)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.dtype)
        st["step"] += 1
        g = p.grad.float()
        m = st["exp_avg"].float().lerp_(g, 1 - b1)  # the state itself when float32
        v = st["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
        del g  # each float32 temporary goes as soon as it is used: see add_update
        st["exp_avg"].copy_(m)
        st["exp_avg_sq"].copy_(v)
        denom = v.div(1 - b2 ** st["step"]).sqrt_().add_(group["eps"])
        del v
        update = torch.div(m, denom, out=denom).mul_(-lr / (1 - b1 ** st["step"]))
        del m, denom
        add_update(p, update, self.compensation, st, lr * wd)


def own_optimizer_kwargs(train: Any) -> dict[str, Any]:
    """`state_dtype` and `compensation` for the harness's own optimizers (GaLore's and those
    built on it): bf16-true only; state_dtype None where the moments follow the bf16 weights."""
    if train.precision != "bf16-true":
        return {}
    dtype = STATE_DTYPES[train.state_dtype]
    return {"state_dtype": None if dtype == torch.bfloat16 else dtype,
            "compensation": train.update_compensation}


def pure_adamw(groups: list[dict[str, Any]], train: Any, betas: tuple[float, float],
               eps: float) -> torch.optim.Optimizer:
    """The AdamW of a bf16-true run (`train`: its TrainConfig): torch-optimi's where it fits
    (bfloat16 states, round to nearest or Kahan summation), else the AdamW above."""
    common = {"lr": train.lr, "betas": betas, "eps": eps}
    mode = train.update_compensation
    if train.state_dtype == "bfloat16" and mode != "stochastic_rounding":
        import optimi

        return optimi.AdamW(groups, **common, kahan_sum=mode == "kahan")
    return AdamW(groups, **common, state_dtype=train.state_dtype, compensation=mode)
