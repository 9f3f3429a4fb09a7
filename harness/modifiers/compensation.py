"""bf16-true: how an optimizer's update is added to a bfloat16 weight, for every optimizer of the
harness that computes its update itself (the AdamW below, GaLore's and those built on it).

bfloat16 keeps 8 significant bits: an update smaller than half a unit in the last place of the
weight is lost when the sum is rounded to nearest (`none`, what the GaLore and Q-GaLore
reference code does). `stochastic_rounding` rounds the float32 sum up or down at random, with
the probability that makes the expected result exact. `kahan` keeps, per weight, a bfloat16
buffer of what rounding lost (Kahan summation) and adds it back with the next update; the
buffer lives in the optimizer state (`KAHAN`), so checkpoints keep it and a resume is exact.
Stochastic rounding draws from torch's global generator, which checkpoints keep too.
`add_update` adds one weight's update; `add_updates` the same arithmetic over a chunk of pieces
of several weights (train.update_chunk, modifiers/multi_tensor.py), with the same bits."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from harness.distributed.fsdp import local
from harness.modifiers.multi_tensor import (
    Kernel,
    Views,
    adam_update,
    chunks,
    fresh_pieces,
    kernel_update,
)

KAHAN = "kahan_comp"  # the state key of the compensation buffer (torch-optimi's name)
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def round_stochastically_(value: Tensor) -> Tensor:
    """A contiguous float32 `value`, in place, rounded to one of its two bfloat16 neighbours,
    the upper one with probability (distance to the lower) / (their gap): random low 16 bits
    added to the float32 pattern, then truncated (sign-magnitude makes it right for negatives
    too); a copy into bfloat16 is then exact. The noise, one draw an element in order from
    torch's generator, is the only temporary (4 bytes an element)."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    bits.add_(noise).bitwise_and_(-65536)
    return value


def stochastic_round_(out: Tensor, value: Tensor) -> None:
    """`out` (bfloat16) <- float32 `value` rounded stochastically (`round_stochastically_`)."""
    out.copy_(round_stochastically_(value.contiguous()))


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


def add_updates(params: list[Tensor], update: list[Tensor], mode: str,
                comps: list[Tensor] | None, decay: float, scratch: list[Tensor]) -> None:
    """`add_update` over a chunk: `params` pieces of weights of one dtype, `update` their
    float32 updates (consumed), `comps` their Kahan buffers ("kahan"), `scratch` float32
    tensors of their shapes to hold the weights' copy (emptied here: freed when the caller
    holds no other reference). The same operations in the same order, so the same bits."""
    if params[0].dtype != torch.bfloat16:
        if decay:
            torch._foreach_add_(update, params, alpha=-decay)
        torch._foreach_add_(params, update)
        return
    weight = list(scratch)
    scratch.clear()
    torch._foreach_copy_(weight, params)
    if decay:
        torch._foreach_add_(update, weight, alpha=-decay)
    torch._foreach_add_(update, weight)
    if mode == "kahan" and comps is not None:
        torch._foreach_copy_(weight, comps)
        torch._foreach_add_(update, weight)
        torch._foreach_copy_(params, update)  # round to nearest; what that lost goes to the buffer
        torch._foreach_copy_(weight, params)
        torch._foreach_sub_(update, weight)
        torch._foreach_copy_(comps, update)
        return
    del weight
    if mode == "stochastic_rounding":
        for u in update:  # one draw a piece, in order: the generator's sequence of the whole
            round_stochastically_(u)
    elif mode != "none":
        raise ValueError(f"unknown update compensation {mode!r}")
    torch._foreach_copy_(params, update)


def kernel_steps(kernel: Kernel, group: dict[str, Any], params: list[Tensor],
                 grads: list[Tensor], states: list[dict[str, Any]], dtype: torch.dtype | None,
                 mode: str, limit: int) -> None:
    """The unprojected exact step of GaLore's and APOLLO's optimizers (an AdamW kernel on a
    zeroed scratch, the float32 -N times lr added by `add_update`) over chunks of whole
    tensors of at most `limit` elements (the fused kernel's bits depend on where a tensor
    starts: modifiers/multi_tensor.py), a larger tensor alone. `dtype`: the moments' (None:
    the gradients'); `params` and `grads` as this rank holds them."""
    lr, decay = group["lr"], group["lr"] * group["weight_decay"]
    for p, g, st in zip(params, grads, states, strict=True):
        if "exp_avg" not in st:
            st.update(step=0, exp_avg=torch.zeros_like(g, dtype=dtype or g.dtype),
                      exp_avg_sq=torch.zeros_like(g, dtype=dtype or g.dtype))
        if mode == "kahan" and p.dtype == torch.bfloat16 and KAHAN not in st:
            st[KAHAN] = torch.zeros_like(p)
    index = {id(p): i for i, p in enumerate(params)}
    for same in alike(params, dict(zip(params, states, strict=True))):
        at = [index[id(p)] for p in same]
        for chunk in chunks([p.numel() for p in same], limit, whole=True):
            idx = [at[i] for i, _, _ in chunk]
            update, scratch = kernel_update(kernel, group, [grads[i] for i in idx],
                                            [states[i] for i in idx], dtype)
            torch._foreach_mul_(update, lr)
            comps = [states[i][KAHAN] for i in idx] if KAHAN in states[idx[0]] else None
            add_updates([params[i] for i in idx], update, mode, comps, decay, scratch)
            del update, scratch  # not alive beside the next chunk's


def restore_dtypes(optimizer: torch.optim.Optimizer, load: Callable[[dict[str, Any]], None],
                   state_dict: dict[str, Any]) -> None:
    """torch's `load_state_dict` casts every state tensor to its parameter's dtype: put the
    saved tensors back as they were (float32 moments of a bfloat16 weight), so that a resume is
    exact."""
    # keyed by position in the groups' params: by index, or by parameter name (torch's
    # set_state_dict passes a checkpoint's states so)
    ids = [k for g in state_dict["param_groups"] for k in g["params"]]
    at = {key: i for i, key in enumerate(ids)}
    saved = {at.get(key, key): {k: v for k, v in s.items() if isinstance(v, Tensor)}
             for key, s in state_dict["state"].items()}
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
    and added by `add_update` with `compensation`. Decoupled weight decay, as torch's AdamW.
    `update_chunk` > 0: the same arithmetic in multi-tensor ops over chunks of at most that
    many elements (`add_updates`), bitwise the same; 0: one parameter at a time."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_dtype: str = "float32",
                 compensation: str = "none", update_chunk: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.dtype, self.compensation = STATE_DTYPES[state_dtype], compensation
        self.chunk, self.views = update_chunk, Views()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self.chunk:
            return super().step(closure)
        loss = None if closure is None else closure()
        with torch.no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                for p in params:
                    self._count(p)
                for same in alike(params, self.state):
                    self._chunked(group, same)
        self.views.done()
        return loss

    def _count(self, p: Tensor) -> None:
        """A step of p's state: made at its first (zero moments), its counter advanced."""
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=self.dtype)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.dtype)
            if self.compensation == "kahan" and p.dtype == torch.bfloat16:
                st[KAHAN] = torch.zeros_like(p)
        st["step"] += 1

    def _chunked(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """`_update`'s arithmetic over parameters of one dtype and step count, by chunks."""
        states = [self.state[p] for p in params]
        # fsdp: this rank's rows of each (views), as multi-tensor ops take plain tensors
        grads = [local(p.grad) for p in params]
        kept = {k: [local(st[k]) for st in states] for k in ("exp_avg", "exp_avg_sq")}
        comps = [local(st[KAHAN]) for st in states] if KAHAN in states[0] else None
        params = [local(p) for p in params]
        step, decay = states[0]["step"], group["lr"] * group["weight_decay"]
        whole = not params[0].is_contiguous()  # no flat view to cut it by
        for chunk in chunks([p.numel() for p in params], self.chunk, whole):
            update, scratch = adam_update(
                fresh_pieces(grads, chunk), self.views.pieces(kept["exp_avg"], chunk),
                self.views.pieces(kept["exp_avg_sq"], chunk), step, group)
            add_updates(self.views.pieces(params, chunk), update, self.compensation,
                        None if comps is None else self.views.pieces(comps, chunk), decay,
                        scratch)
            del update, scratch  # not alive beside the next chunk's

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
        keep_rounded(st, {"exp_avg": m, "exp_avg_sq": v})
        denom = v.div(1 - b2 ** st["step"]).sqrt_().add_(group["eps"])
        del v
        update = torch.div(m, denom, out=denom).mul_(-lr / (1 - b1 ** st["step"]))
        del m, denom
        add_update(p, update, self.compensation, st, lr * wd)


def keep_rounded(st: dict[str, Any], values: dict[str, Tensor]) -> None:
    """States updated in float32 copies, copied back where a state is not that copy itself
    (a float32 state's `.float()` is the state: no copy onto itself)."""
    for key, value in values.items():
        if st[key] is not value:
            st[key].copy_(value)


def alike(params: list[Tensor], state: Any) -> list[list[Tensor]]:
    """`params` in runs that one multi-tensor op can take: the same dtype and step count
    (their bias corrections are one scalar), contiguous or not (a chunk cuts only those with
    a flat view); order kept."""
    runs: dict[tuple[Any, ...], list[Tensor]] = {}
    for p in params:
        key = (p.dtype, p.device, state[p].get("step"), p.is_contiguous())
        runs.setdefault(key, []).append(p)
    return list(runs.values())


def own_optimizer_kwargs(train: Any, chunked: bool = False) -> dict[str, Any]:
    """`state_dtype` and `compensation` for the harness's own optimizers (GaLore's and those
    built on it): bf16-true only; state_dtype None where the moments follow the bf16 weights.
    `chunked`: with `update_chunk`, for an optimizer that takes multi-tensor updates."""
    if train.precision != "bf16-true":
        return {}
    dtype = STATE_DTYPES[train.state_dtype]
    chunk = {"update_chunk": train.update_chunk} if chunked else {}
    return {"state_dtype": None if dtype == torch.bfloat16 else dtype,
            "compensation": train.update_compensation, **chunk}


def pure_adamw(groups: list[dict[str, Any]], train: Any, betas: tuple[float, float],
               eps: float) -> torch.optim.Optimizer:
    """The AdamW of a bf16-true run (`train`: its TrainConfig): torch-optimi's where it fits
    (bfloat16 states, round to nearest or Kahan summation), else the AdamW above."""
    common = {"lr": train.lr, "betas": betas, "eps": eps}
    mode = train.update_compensation
    if train.state_dtype == "bfloat16" and mode != "stochastic_rounding":
        import optimi

        return optimi.AdamW(groups, **common, kahan_sum=mode == "kahan")
    return AdamW(groups, **common, state_dtype=train.state_dtype, compensation=mode,
                 update_chunk=train.update_chunk)
