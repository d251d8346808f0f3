"""fp32_logits: logits of low-precision inputs come out in fp32, unrounded, with gradients."""
from __future__ import annotations

import pytest
import torch

from services.common.numerics import fp32_logits


def _inputs(device: str):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(6, 32, generator=g) * 4).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(50, 32, generator=g).to(device, torch.bfloat16).requires_grad_()
    return h, w


def _check(device: str) -> None:
    h, w = _inputs(device)
    out = fp32_logits(h, w)
    ref = h.detach().float() @ w.detach().float().t()
    assert out.dtype == torch.float32 and out.shape == (6, 50)
    torch.testing.assert_close(out.detach(), ref, rtol=1e-5, atol=1e-4)
    # what the stock projection returns: rounded to bf16, visibly off
    assert (ref.bfloat16().float() - ref).abs().max() > 1e-2
    c = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(device)
    (out * c).sum().backward()  # linear in the logits: both paths must give the same gradients
    h2, w2 = _inputs(device)
    ((h2 @ w2.t()).float() * c).sum().backward()  # the stock projection's backward
    torch.testing.assert_close(h.grad.float(), h2.grad.float(), rtol=0.02, atol=0.05)
    torch.testing.assert_close(w.grad.float(), w2.grad.float(), rtol=0.02, atol=0.05)


def test_cpu_bf16_is_upcast_with_gradients():
    _check("cpu")


def test_fp32_inputs_pass_through():
    h, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(fp32_logits(h, w), h @ w.t())
    assert fp32_logits(h[None], w).shape == (1, 3, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matmul_with_fp32_output_and_backward():
    _check("cuda")
