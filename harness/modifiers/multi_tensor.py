"""Multi-tensor updates (`train.update_chunk`): bf16-true's float32 updates computed by
`torch._foreach_*` ops over chunks of at most `update_chunk` elements instead of one parameter
at a time, for the optimizers that add their updates with modifiers/compensation.py.

A chunk holds flat pieces of the tensors it updates: several small tensors, or a slice of a
large one, so that its float32 temporaries are bounded by the chunk, not by the largest weight.
Its temporaries are flat buffers, split into one view per piece; the weights', the states' and
the Kahan buffers' flat views are kept between steps (`Views`), so a step makes views of its
fresh gradients only. On the CPU every elementwise kernel used here gives the same bits wherever
a tensor is cut, and torch's CPU generator draws stochastic rounding's noise one value an element
in order: a chunked step is bitwise the per-parameter one (tests/modifiers/test_multi_tensor.py).
torch's fused AdamW kernel is the exception: its vectorized body and scalar tail round
differently, so its chunks hold whole tensors (`chunks(..., whole=True)`), a tensor larger than
the chunk alone in its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Piece = tuple[int, int, int]  # (index of the tensor, first element, element after the last)
# AdamW on lists (methods/adam_kernel.py's AdamKernel): group, targets, grads, states, lr, decay
Kernel = Callable[[dict[str, Any], list[Tensor], list[Tensor], list[dict[str, Any]], float,
                   float], None]


def chunks(sizes: list[int], limit: int, whole: bool = False) -> list[list[Piece]]:
    """The tensors of `sizes`, in order, cut into chunks of at most `limit` elements; `whole`:
    never cut a tensor (one larger than `limit` is a chunk alone)."""
    out: list[list[Piece]] = []
    current: list[Piece] = []
    room = limit
    for i, n in enumerate(sizes):
        if whole:
            if n > room and current:
                out.append(current)
                current, room = [], limit
            current.append((i, 0, n))
            room -= n
            continue
        start = 0
        while start < n:
            if room <= 0:
                out.append(current)
                current, room = [], limit
            stop = min(n, start + room)
            current.append((i, start, stop))
            room -= stop - start
            start = stop
    if current:
        out.append(current)
    return out


def lengths(chunk: list[Piece]) -> list[int]:
    return [stop - start for _, start, stop in chunk]


def buffer(sizes: list[int], like: Tensor, dtype: torch.dtype = torch.float32,
           zero: bool = False) -> tuple[Tensor, list[Tensor]]:
    """A flat temporary of `sizes` elements in all and its view of each (two dispatched ops)."""
    make = torch.zeros if zero else torch.empty
    flat = make(sum(sizes), dtype=dtype, device=like.device)
    return flat, list(flat.split(sizes))


def _cut(t: Tensor, start: int, stop: int) -> Tensor:
    flat = t.view(-1)
    return flat if start == 0 and stop == flat.numel() else flat[start:stop]


class Views:
    """Flat views of the tensors an optimizer keeps (weights, states, Kahan buffers), made
    once and reused while the tensor is the same object. A step calls `done` at its end, which
    forgets the views it did not use (a state replaced by a resume), so that no view keeps an
    old tensor alive."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        self._used: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}

    def pieces(self, tensors: list[Tensor], chunk: list[Piece]) -> list[Tensor]:
        return [self._piece(tensors[i], start, stop) for i, start, stop in chunk]

    def _piece(self, t: Tensor, start: int, stop: int) -> Tensor:
        key = (id(t), start, stop)
        hit = self._used.get(key) or self._kept.get(key)
        if hit is None or hit[0] is not t:
            hit = (t, _cut(t, start, stop))
        self._used[key] = hit
        return hit[1]

    def done(self) -> None:
        self._kept, self._used = self._used, {}


def fresh_pieces(tensors: list[Tensor], chunk: list[Piece]) -> list[Tensor]:
    """Flat pieces of tensors that are new each step (gradients): not kept."""
    return [_cut(tensors[i], start, stop) for i, start, stop in chunk]


def adam_update(grads: list[Tensor], exp_avg: list[Tensor], exp_avg_sq: list[Tensor],
                chunk: list[Piece], step: int,
                hyper: dict[str, Any]) -> tuple[Tensor, list[Tensor]]:
    """One chunk of compensation.AdamW's update, in the same float32 operations: the moments
    (pieces of the states, float32 or bfloat16) updated in place, the flat float32 update
    (-lr·m̂/(√v̂ + eps)) and its pieces returned. Two float32 temporaries of the chunk at once
    with float32 moments; with bfloat16 ones, their float32 copies as well."""
    (b1, b2), lr, eps = hyper["betas"], hyper["lr"], hyper["eps"]
    sizes = lengths(chunk)
    g, g_parts = buffer(sizes, grads[0])
    torch._foreach_copy_(g_parts, grads)
    m, v, m_flat, v_flat = exp_avg, exp_avg_sq, None, None
    if exp_avg[0].dtype != torch.float32:  # arithmetic on float32 copies, then rounded back
        m_flat, m = buffer(sizes, g)
        v_flat, v = buffer(sizes, g)
        torch._foreach_copy_(m, exp_avg)
        torch._foreach_copy_(v, exp_avg_sq)
    torch._foreach_lerp_(m, g_parts, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g_parts, g_parts, value=1 - b2)
    if m is not exp_avg:
        torch._foreach_copy_(exp_avg, m)
        torch._foreach_copy_(exp_avg_sq, v)
    denom = g  # the gradient's float32 copy is used up: its buffer takes the denominator
    torch._foreach_copy_(g_parts, v)
    del v, g_parts, v_flat
    denom.div_(1 - b2**step).sqrt_().add_(eps)
    if m is exp_avg:
        update, parts = buffer(sizes, denom)
        torch._foreach_copy_(parts, m)
    else:
        update, parts = m_flat, m
    del m, m_flat
    update.div_(denom).mul_(-lr / (1 - b1**step))
    return update, parts


def kernel_update(kernel: Kernel, group: dict[str, Any], grads: list[Tensor],
                  states: list[dict[str, Any]], chunk: list[Piece],
                  dtype: torch.dtype | None) -> tuple[Tensor, list[Tensor]]:
    """One chunk of whole tensors through an AdamW kernel on a zeroed scratch (lr 1, no
    decay), which leaves -N there, as GaLore's and APOLLO's unprojected exact path does weight
    by weight: `grads` are flat pieces, cast to `dtype` (the moments' dtype, None: as they are),
    `states` one dict of flat moment views per piece (their counters advanced by the caller).
    Returns the float32 -N and its pieces."""
    sizes = lengths(chunk)
    if dtype is not None and grads[0].dtype != dtype:
        grads_in = grads
        _, grads = buffer(sizes, grads_in[0], dtype)  # its views keep it, until `del grads`
        torch._foreach_copy_(grads, grads_in)
        del grads_in
    update, out = buffer(sizes, grads[0], grads[0].dtype, zero=True)
    kernel(group, out, grads, states, 1.0, 0.0)
    del grads
    if update.dtype != torch.float32:
        update = update.float()
        out = list(update.split(sizes))
    return update, out
