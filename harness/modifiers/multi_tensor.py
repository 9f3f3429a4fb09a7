"""Multi-tensor updates (`train.update_chunk`): bf16-true's float32 updates computed by
`torch._foreach_*` ops over chunks of at most `update_chunk` elements instead of one parameter
at a time, for the optimizers that add their updates with modifiers/compensation.py.

A chunk holds pieces of the tensors it updates: several small tensors whole, or a slice of a
large one (a flat view), so that its float32 temporaries are bounded by the chunk, not by the
largest weight. The temporaries are lists of one tensor a piece, made by one multi-tensor op
(a clone of a float32 list of the same shapes, whose values are then overwritten), so that a
step dispatches a few operators a chunk and views only for the pieces it cuts. On the CPU every
elementwise kernel used here gives the same bits wherever a tensor is cut, and torch's CPU
generator draws stochastic rounding's noise one value an element in order: a chunked step is
bitwise the per-parameter one (tests/modifiers/test_multi_tensor.py). torch's fused AdamW
kernel is the exception: its vectorized body and scalar tail round differently, so its chunks
hold whole tensors (`chunks(..., whole=True)`), a tensor larger than the chunk alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Piece = tuple[int, int, int]  # (index of the tensor, first element, element after the last)
# Elements a piece of elementwise float32 work takes at once where the run leaves it to the
# device: multi-tensor updates' chunks, and the loss's pieces (harness/train/lm_loss.py). A CPU
# runs faster on pieces its caches hold (and that its allocator reuses rather than maps anew
# each step); a GPU on pieces large enough that their kernels' launches do not add up.
PIECE = {"cpu": 1 << 20, "cuda": 1 << 24}
# AdamW on lists (methods/adam_kernel.py's AdamKernel): group, targets, grads, states, lr, decay
Kernel = Callable[[dict[str, Any], list[Tensor], list[Tensor], list[dict[str, Any]], float,
                   float], None]


def piece(device: str) -> int:
    """`PIECE` for a device type (CUDA's for any but a CPU)."""
    return PIECE.get(device, PIECE["cuda"])


def update_chunk(train: Any, device: str) -> int:
    """The run's `train.update_chunk` on a device of type `device`: its own, or the device's."""
    return piece(device) if train.update_chunk is None else train.update_chunk


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


class Views:
    """The pieces of the tensors an optimizer keeps (weights, states, Kahan buffers): a whole
    tensor itself; a slice of a cut one from its flat view, kept while the tensor is the same
    object and sliced again each step, so that each step's operators read the whole tensor
    (which the CPU's tensor-peak timeline, harness/cost/tensor_peak.py, sizes it by). A step
    calls `done` at its end, which forgets the views it did not use (a state replaced by a
    resume), so that no view keeps an old tensor alive."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Tensor, Tensor]] = {}
        self._used: dict[int, tuple[Tensor, Tensor]] = {}

    def pieces(self, tensors: list[Tensor], chunk: list[Piece]) -> list[Tensor]:
        return [self._piece(tensors[i], start, stop) for i, start, stop in chunk]

    def _piece(self, t: Tensor, start: int, stop: int) -> Tensor:
        if start == 0 and stop == t.numel():
            return t
        hit = self._used.get(id(t)) or self._kept.get(id(t))
        if hit is None or hit[0] is not t:
            hit = (t, t.view(-1))
        self._used[id(t)] = hit
        return hit[1][start:stop]

    def done(self) -> None:
        self._kept, self._used = self._used, {}


def fresh_pieces(tensors: list[Tensor], chunk: list[Piece]) -> list[Tensor]:
    """The pieces of tensors that are new each step (gradients; read only: a strided one is
    copied flat)."""
    return [tensors[i] if start == 0 and stop == tensors[i].numel()
            else tensors[i].reshape(-1)[start:stop] for i, start, stop in chunk]


def float32_like(pieces: list[Tensor]) -> list[Tensor]:
    """New float32 tensors shaped as `pieces`, to be overwritten: one clone of a float32 list
    (one dispatched op), else one empty tensor a piece."""
    if pieces[0].dtype == torch.float32:
        return list(torch._foreach_clone(pieces))
    return [torch.empty_like(t, dtype=torch.float32) for t in pieces]


def adam_update(grads: list[Tensor], exp_avg: list[Tensor], exp_avg_sq: list[Tensor],
                step: int, hyper: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
    """One chunk of compensation.AdamW's update, in the same float32 operations: the moments
    (pieces of the states, float32 or bfloat16) updated in place; returns the float32 update
    (-lr·m̂/(√v̂ + eps)) and a float32 scratch of the same shapes (the denominator's, free now).
    Two float32 temporaries of the chunk at once with float32 moments; with bfloat16 ones,
    their float32 copies as well."""
    (b1, b2), lr, eps = hyper["betas"], hyper["lr"], hyper["eps"]
    g = float32_like(exp_avg)
    torch._foreach_copy_(g, grads)
    m, v = exp_avg, exp_avg_sq
    if exp_avg[0].dtype != torch.float32:  # arithmetic on float32 copies, then rounded back
        m, v = float32_like(g), float32_like(g)
        torch._foreach_copy_(m, exp_avg)
        torch._foreach_copy_(v, exp_avg_sq)
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, value=1 - b2)
    if m is not exp_avg:
        torch._foreach_copy_(exp_avg, m)
        torch._foreach_copy_(exp_avg_sq, v)
    # Two allocations a step, each reused: a CPU's fresh pages cost more than a pass.
    denom = g  # the gradient's float32 copy is used up: it takes the denominator
    torch._foreach_copy_(denom, v)
    del g, v
    torch._foreach_div_(denom, 1 - b2**step)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = list(torch._foreach_clone(m)) if m is exp_avg else m  # m / denom, in place
    del m
    torch._foreach_div_(update, denom)
    torch._foreach_mul_(update, -lr / (1 - b1**step))
    return update, denom


def kernel_update(kernel: Kernel, group: dict[str, Any], grads: list[Tensor],
                  states: list[dict[str, Any]],
                  dtype: torch.dtype | None) -> tuple[list[Tensor], list[Tensor]]:
    """Whole tensors through an AdamW kernel on a zeroed scratch (lr 1, no decay), which leaves
    -N there, as GaLore's and APOLLO's unprojected exact path does weight by weight: `grads`
    cast to `dtype` (the moments' dtype, None: as they are), `states` the tensors' own, their
    moments made (the kernel advances them). Returns the float32 -N and a float32 scratch of
    the same shapes."""
    cast = None
    if dtype is not None and grads[0].dtype != dtype:
        cast = list(torch._foreach_clone([st["exp_avg"] for st in states]))
        torch._foreach_copy_(cast, grads)
        grads = cast
    update = list(torch._foreach_clone(grads))
    torch._foreach_zero_(update)
    kernel(group, update, grads, states, 1.0, 0.0)
    del grads
    if update[0].dtype != torch.float32:
        update = [u.float() for u in update]
    if cast is None or cast[0].dtype != torch.float32:  # no float32 copy to reuse
        cast = list(torch._foreach_clone(update))
    return update, cast
