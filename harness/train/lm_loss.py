"""The next-token loss of pretraining, summed over real targets, without copies of the logits.

The labels are shifted left (the last position gets IGNORE), so the logits are used as the
model returns them. The cross-entropy keeps the logits in their own dtype and the float32
log-sum-exp of each token; float32 exists only for one piece of the tokens at a time, in
forward and in backward, where the gradient is written piece by piece in the logits' dtype.

With `chunk` tokens (`train.loss_chunk`), the head's matmul joins the loss: the model's last
hidden state and the head weight go in, each chunk's logits are made, reduced and dropped, and
made again in backward, so no more than a chunk's logits exist at once. With liger kernels
(`model_options.kernels: liger`) liger-kernel's fused linear cross-entropy does the same on a
CUDA device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from harness.cost.activations import loss_rows
from harness.data.loader import IGNORE
from harness.errors import UserError
from harness.modifiers.kernels import liger_linear_cross_entropy

HeadLoss = Callable[..., torch.Tensor]

# logit post-processing in some HF configs: logits are not then the head's matmul
SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next token's label; the last position has none."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)


def _piece_loss(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 log-sum-exp of logits `x` (rows × vocab) and their summed loss over targets `t`."""
    x = x.float()
    top = x.amax(dim=-1, keepdim=True)
    lse = (x - top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
    picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(t != IGNORE, lse - picked, 0.0).sum()


def _piece_grad(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    """d(summed loss)/d(logits) of one piece, float32: softmax minus one-hot, times `scale`;
    zero on ignored rows."""
    grad = (x.float() - lse.unsqueeze(1)).exp_()
    real = (t != IGNORE).unsqueeze(1)
    grad.scatter_add_(1, t.clamp(min=0).unsqueeze(1), real.to(grad.dtype).neg())
    return grad.mul_(torch.where(real, scale, 0.0))


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of (tokens × vocab) logits; saves the logits and a float32
    log-sum-exp per token."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                rows: int) -> torch.Tensor:
        lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
        total = logits.new_zeros((), dtype=torch.float32)
        for s in range(0, logits.shape[0], rows):
            lse[s : s + rows], piece = _piece_loss(logits[s : s + rows], targets[s : s + rows])
            total += piece
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        rows = ctx.rows
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            grad[s : s + rows] = _piece_grad(logits[s : s + rows], targets[s : s + rows],
                                             lse[s : s + rows], g)
        return grad, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of (batch × seq × vocab) logits against unshifted `labels`."""
    flat = logits.flatten(0, 1)
    rows = loss_rows(flat.shape[1], flat.device.type)
    return _CrossEntropySum.apply(flat, shifted(labels).flatten(), rows)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's where it is on, else the hidden state's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _LinearCrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T`, `chunk` tokens' logits at a time, made again
    in backward; saves the hidden state, the weight and a float32 log-sum-exp per token. The
    matmuls run in `dtype` (autocast's, as the head's linear would), the weight's gradient is
    summed over chunks in float32."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                targets: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
        w = weight.to(dtype)
        lse = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk):
            logits = hidden[s : s + chunk].to(dtype) @ w.t()
            lse[s : s + chunk], piece = _piece_loss(logits, targets[s : s + chunk])
            total += piece
            del logits  # before the next chunk's: one chunk's logits at a time
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(dtype)
            logits = h @ w.t()
            d = _piece_grad(logits, targets[s : s + chunk], lse[s : s + chunk], g).to(dtype)
            grad_hidden[s : s + chunk] = d @ w
            grad_weight += d.t() @ h
            del logits, d  # before the next chunk's
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk: int) -> torch.Tensor:
    """Summed next-token loss of the head `weight` over (batch × seq × hidden) `hidden`
    against unshifted `labels`, `chunk` tokens' logits at a time."""
    return _LinearCrossEntropySum.apply(hidden.flatten(0, 1), weight,
                                        shifted(labels).flatten(), chunk, _compute_dtype(hidden))


def head_input(net: nn.Module, head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's last hidden state as its head receives it, from a forward through `net`
    (DDP's wrapper included, which must see every forward) in which the head gets no tokens:
    no logits are made, and the head's weight reaches the loss only through the caller."""
    kept: list[torch.Tensor] = []

    def take(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        kept.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        net(input_ids=ids)
    finally:
        handle.remove()
    return kept[0]


def check_head(model: nn.Module) -> nn.Linear:
    """The head of a model whose logits are its plain matmul (no bias, scale or softcap), which
    a loss given the hidden state and the head weight can stand in for."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    scaled = [k for k in SCALED_LOGITS if getattr(model.config, k, None) not in (None, 1, 1.0)]
    if not isinstance(head, nn.Linear) or head.bias is not None or scaled:
        why = f"its config sets {scaled[0]}" if scaled else "its head is no bias-free linear"
        raise UserError(f"train.loss_chunk / model_options.kernels liger: this model's logits "
                        f"are not its head's matmul ({why}); use loss_chunk 0 and kernels torch")
    return head


def head_loss(chunk: int, kernels: str) -> tuple[HeadLoss, bool]:
    """The loss after the model's last hidden state, and whether it takes that state and the
    head weight (else the logits): (logits, labels) at chunk 0 with torch's kernels, else
    (hidden, weight, labels) by `chunk` tokens or liger's fused kernel."""
    if kernels == "liger":
        fused = liger_linear_cross_entropy()

        # liger's own Triton kernels, left out of train.compile's graph: nothing to fuse, and
        # its host read of the target count would break a full graph
        @torch._dynamo.disable
        def liger(hidden: torch.Tensor, weight: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
            return fused(hidden.flatten(0, 1), weight, shifted(labels).flatten())

        return liger, True
    if chunk:
        return functools.partial(linear_cross_entropy_sum, chunk=chunk), True
    return cross_entropy_sum, False


def next_token_loss(net: nn.Module, ids: torch.Tensor, labels: torch.Tensor, loss: HeadLoss,
                    from_hidden: bool) -> torch.Tensor:
    """Summed next-token loss of `net` (a causal LM, or DDP around one) on `ids`, by `loss`
    (`head_loss`) on its logits or on its last hidden state and head weight."""
    if not from_hidden:
        return loss(net(input_ids=ids).logits, labels)
    head = check_head(getattr(net, "module", net))  # DDP's model
    return loss(head_input(net, head, ids), head.weight, labels)
