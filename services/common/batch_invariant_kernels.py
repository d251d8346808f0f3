"""Triton kernels whose result for one row never depends on the other rows: matmul, RMSNorm, attention.

A cuBLAS GEMM picks its kernel (tile shape, split-K, stream-K, GEMV) from the
problem size, so the engine's decode step (a few rows) and the trainer's full
pass (thousands of rows) sum the same products in different orders. Here every
launch of a kernel uses one compiled binary with fixed tiles, and an output
element is always reduced the same way:

* matmul: fixed BLOCK_M/N/K, no split-K; an element is acc += dot(A-tile, W-tile)
  over K-blocks in order, whatever M is.
* RMSNorm: one program per row.
* attention: one program per (query block, head); keys are visited in blocks
  aligned to absolute positions, with the flash-attention online softmax. A
  query at position p sees the same key blocks in the same order whether it is
  the only query (decode) or one of a whole causal sequence (prefill, training).
  Blocks after p are fully masked: they leave the running max, sum and output
  unchanged exactly (alpha = 2^0 = 1, p = 0).

Sizes that vary between callers (rows, sequence lengths) are not specialised
on, so Triton compiles no size-dependent variant. Only 16-bit inputs come here.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MATMUL_BLOCKS = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8)
ATTN_BLOCK_M, ATTN_BLOCK_N = 16, 64


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # C[M, N] = A[M, K] @ W[N, K]^T (+ bias), fp32 accumulation; grouped tile order for L2 reuse.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    w_tile = w_ptr + rn[None, :] * stride_wn + rk[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_tile, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        w = tl.load(w_tile, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
        acc = tl.dot(a, w, acc)
        a_tile += BLOCK_K * stride_ak
        w_tile += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    # The HF formula: weight * (x_fp32 * rsqrt(mean(x^2) + eps)).to(dtype), the product rounded once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, rows_ptr,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                      H, Lq, Lk, scale_log2,
                      GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Query i of row b sits at position pos[b] + i and sees keys [0, pos[b] + i] of kv row rows[b].
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUPS
    pos0 = tl.load(pos_ptr + b)
    kv_row = tl.load(rows_ptr + b).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :],
                mask=offs_m[:, None] < Lq, other=0.0)
    q_pos = pos0 + offs_m
    k_base = k_ptr + kv_row * sk_b + kvh * sk_h
    v_base = v_ptr + kv_row * sv_b + kvh * sv_h
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    hi = tl.minimum(pos0 + (pid_m + 1) * BLOCK_M, Lk)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[None, :] * sk_t + offs_d[:, None], mask=offs_n[None, :] < Lk, other=0.0)
        s = tl.dot(q, k) * scale_log2
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    o = o_ptr + b.to(tl.int64) * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Lq)


def matmul(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ weight[N, K].T (+ bias) -> [M, N] in out_dtype."""
    m, k = a.shape
    n = weight.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    blocks = MATMUL_BLOCKS
    grid = (triton.cdiv(m, blocks["BLOCK_M"]) * triton.cdiv(n, blocks["BLOCK_N"]),)
    _matmul_kernel[grid](a, weight, bias if bias is not None else weight, c, m, n, k,
                         a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), c.stride(0), c.stride(1),
                         HAS_BIAS=bias is not None, num_warps=4, num_stages=3, **blocks)
    return c


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [R, N] (rows contiguous) normalised row by row."""
    rows, n = x.shape
    y = torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, y, x.stride(0), y.stride(0), n, eps,
                                  BLOCK=triton.next_power_of_2(n), num_warps=4)
    return y


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              kv_rows: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """q [B, H, Lq, D]; k, v [S, KV, >=kv_len, D]; positions, kv_rows int32 [B]. Returns [B, Lq, H, D]."""
    b, h, lq, d = q.shape
    groups = h // k.shape[1]
    out = torch.empty((b, lq, h, d), dtype=q.dtype, device=q.device)
    if b == 0 or lq == 0:
        return out
    grid = (triton.cdiv(lq, ATTN_BLOCK_M), b * h)
    _attention_kernel[grid](q, k, v, out, positions, kv_rows,
                            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(2), out.stride(1),
                            h, lq, kv_len, scale * math.log2(math.e),
                            GROUPS=groups, D=d, BLOCK_M=ATTN_BLOCK_M, BLOCK_N=ATTN_BLOCK_N, num_warps=4)
    return out
