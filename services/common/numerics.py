"""Shared numerics of the engine and the trainer: the vocabulary projection (`project_logits`).

Rounding logits to bf16 moves a log-prob by up to ~0.06 where logits are
around 16-32 (bf16 keeps 8 bits of mantissa), far more than the rest of a
bf16 forward pass differs between a KV-cached decode and one full pass. Both
sides therefore project with an fp32 result when asked to (SGLang's
`--enable-fp32-lm-head`): on CUDA one bf16 matmul that accumulates and
writes fp32 (no fp32 copy of the [V, H] weight), elsewhere an upcast.
"""
from __future__ import annotations

import torch

from services.common import batch_invariant as bi


class _MatmulFp32Out(torch.autograd.Function):
    """h [N, H] @ w[V, H].T with an fp32 result from low-precision inputs. PyTorch has no derivative
    for this matmul; the backward is the one a low-precision matmul followed by `.float()` has."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return torch.mm(h, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w = ctx.saved_tensors
        g = grad.to(w.dtype)
        grad_h = g @ w if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_w


def project_logits(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool = False,
                   batch_invariant: bool = False) -> torch.Tensor:
    """The vocabulary projection both services use, returned as float32: rounded to the weights'
    dtype first unless `fp32`; through the batch-invariant matmul when `batch_invariant`."""
    if batch_invariant:
        return bi.linear(hidden, weight, out_dtype=torch.float32 if fp32 else None).float()
    if fp32:
        return fp32_logits(hidden, weight)
    return (hidden @ weight.t()).float()


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] @ weight[V, H].T as float32, never rounded to the weights' dtype."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return hidden @ weight.t()
    if hidden.is_cuda and hidden.dtype == weight.dtype:
        out = _MatmulFp32Out.apply(hidden.reshape(-1, hidden.shape[-1]), weight)
        return out.view(*hidden.shape[:-1], weight.shape[0])
    return hidden.float() @ weight.float().t()
