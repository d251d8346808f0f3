"""Batch-invariant linear, RMSNorm and causal attention, shared by the engine and the trainer.

The engine samples a token from logits computed in a decode step over a few
rows and a KV cache; the trainer recomputes its log-prob in one pass over
whole sequences. With stock kernels the two disagree in the last bits of every
bf16 op, and 30 layers turn that into a log-prob gap of ~0.01. When both sides
run their forward through these functions (engine `--enable-deterministic-inference`,
trainer `--batch-invariant`), each row is computed by the same fixed-order
kernels (`batch_invariant_kernels`) in both places, so the log-probs agree bit
for bit.

On CUDA with 16-bit tensors the forward uses the Triton kernels; the backward
(trainer only) differentiates the plain torch formula below, recomputed from
the saved inputs: gradients need to be right, not batch-invariant. Elsewhere
(CPU, fp32) the torch formulas run directly: same maths, without the
bitwise guarantee.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The HF decoders whose layers both forwards walk (the engine's, and the trainer's batch-invariant one):
# RMSNorm, q/k/v (optionally biased, Qwen3 with per-head q/k norms), rotary, o, gate/up, SiLU, down.
DECODER_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})


@functools.cache
def _kernels():
    try:
        from services.common import batch_invariant_kernels
    except ImportError:  # no triton (CPU builds of torch)
        return None
    return batch_invariant_kernels


def kernels_available(device: torch.device | str) -> bool:
    """True when the Triton kernels serve this device (CUDA and triton importable)."""
    return torch.device(device).type == "cuda" and _kernels() is not None


def check_head_dim(head_dim: int) -> None:
    """The attention kernel tiles the head dimension whole: it must be a power of two."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"batch-invariant attention needs a power-of-two head dimension >= 16, not {head_dim}")


def _use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _kernels() is not None


def norm_eps(norm: torch.nn.Module) -> float:
    """The epsilon of an HF RMSNorm module (its attribute name varies by model)."""
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The HF rotary formula x*cos + rotate_half(x)*sin (elementwise: batch-invariant as it stands)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# ---- the torch formulas (reference and backward) ---------------------------------------------
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        positions: torch.Tensor | None = None, kv_rows: torch.Tensor | None = None,
                        kv_len: int | None = None) -> torch.Tensor:
    """Causal attention as `attention` defines it, by SDPA; returns [B, Lq, H, D]."""
    gqa = q.shape[1] != k.shape[1]
    if positions is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        length = kv_len if kv_len is not None else k.shape[2]
        rows = kv_rows if kv_rows is not None else torch.arange(q.shape[0], device=q.device)
        keys, values = k[rows, :, :length], v[rows, :, :length]
        q_pos = positions.long()[:, None] + torch.arange(q.shape[2], device=q.device)
        mask = (torch.arange(length, device=q.device)[None, None, :] <= q_pos[:, :, None])[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


# ---- autograd: kernel forward, torch-formula backward ------------------------------------------
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _kernels().matmul(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.to(weight.dtype)
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class _Recomputed(torch.autograd.Function):
    """Forward by a kernel; backward through the torch formula recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, kernel, formula, *inputs):
        ctx.formula = formula
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.formula(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def _tracks_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- the ops ---------------------------------------------------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias), in out_dtype (default x's dtype), fp32 accumulation."""
    out_dtype = out_dtype or x.dtype
    if not _use_kernels(x):
        if out_dtype == torch.float32 and x.dtype != torch.float32:
            x, weight = x.float(), weight.float()
            bias = bias.float() if bias is not None else None
        return F.linear(x, weight, bias).to(out_dtype)
    flat = x.reshape(-1, x.shape[-1])
    if _tracks_grad(x, weight, bias):
        out = _Linear.apply(flat, weight, bias, out_dtype)
    else:
        out = _kernels().matmul(flat, weight, bias, out_dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def norm_module(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`rms_norm` with an HF RMSNorm module's weight and epsilon."""
    return rms_norm(x, norm.weight, norm_eps(norm))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The HF RMSNorm (fp32 normalise, cast, scale by the weight) over the last dim."""
    if not _use_kernels(x):
        return reference_rms_norm(x, weight, eps)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    kernel = functools.partial(_kernels().rms_norm, eps=eps)
    if _tracks_grad(x, weight):
        out = _Recomputed.apply(kernel, functools.partial(reference_rms_norm, eps=eps), flat, weight)
    else:
        out = kernel(flat, weight)
    return out.view(x.shape)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              positions: torch.Tensor | None = None, kv_rows: torch.Tensor | None = None,
              kv_len: int | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, Lq, D] over k, v [S, KV, Lk, D] (grouped heads: head h reads kv head
    h // (H / KV)); returns [B, Lq, H, D].

    Without `positions`: q, k, v are whole sequences (query i sees keys [0, i] of its own row).
    With them: query i of row b sits at position positions[b] + i and reads kv row kv_rows[b]
    (default b) of a cache, keys [0, kv_len). Only the first form is differentiable.
    """
    if not _use_kernels(q):
        return reference_attention(q, k, v, scale, positions, kv_rows, kv_len)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attention needs a unit stride on the head dimension")
    check_head_dim(q.shape[-1])
    b = q.shape[0]
    if positions is None:
        if _tracks_grad(q, k, v):
            return _Recomputed.apply(functools.partial(_whole_sequences, scale=scale),
                                     functools.partial(reference_attention, scale=scale), q, k, v)
        return _whole_sequences(q, k, v, scale)
    rows = kv_rows if kv_rows is not None else torch.arange(b, device=q.device)
    return _kernels().attention(q, k, v, positions.to(torch.int32), rows.to(torch.int32),
                                kv_len if kv_len is not None else k.shape[2], scale)


def _whole_sequences(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    b = q.shape[0]
    zeros = torch.zeros(b, dtype=torch.int32, device=q.device)
    rows = torch.arange(b, dtype=torch.int32, device=q.device)
    return _kernels().attention(q, k, v, zeros, rows, k.shape[2], scale)
