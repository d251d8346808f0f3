"""The decoder's forward through the batch-invariant ops, for `--batch-invariant`.

It runs the HF model's own weights, embeddings and rotary tables through
`services.common.batch_invariant` in the order the engine's forward uses
under `--enable-deterministic-inference`: RMSNorm, q/k/v projections, rotary,
causal attention, output projection, residual, RMSNorm, gate/up, SiLU * up,
down projection, residual; the final norm. Every op there computes a row the
same way whatever the batch, so the trainer's log-probs equal the engine's bit
for bit (on CUDA in bf16/fp16; elsewhere the same maths by torch).

Single process only: it reads the layers' parameters directly, which FSDP2
shards outside a module's own forward.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.common import batch_invariant as bi

def check_supported(lm: nn.Module) -> None:
    arch = type(lm).__name__
    if arch not in bi.DECODER_ARCHITECTURES:
        raise ValueError(f"--batch-invariant supports {', '.join(sorted(bi.DECODER_ARCHITECTURES))}, not {arch}")
    bi.check_head_dim(lm.model.layers[0].self_attn.head_dim)


def _project(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    return bi.linear(x, proj.weight, proj.bias)


def _layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    b, t, _ = x.shape
    d = attn.head_dim
    h = bi.norm_module(layer.input_layernorm, x)
    q = _project(h, attn.q_proj).view(b, t, -1, d)
    k = _project(h, attn.k_proj).view(b, t, -1, d)
    v = _project(h, attn.v_proj).view(b, t, -1, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head norm of q and k before the rotation
        q = bi.norm_module(attn.q_norm, q)
        k = bi.norm_module(attn.k_norm, k)
    q = bi.apply_rotary(q.transpose(1, 2), cos, sin)
    k = bi.apply_rotary(k.transpose(1, 2), cos, sin)
    x = x + _project(bi.attention(q, k, v, attn.scaling).reshape(b, t, -1), attn.o_proj)
    h = bi.norm_module(layer.post_attention_layernorm, x)
    return x + _project(mlp.act_fn(_project(h, mlp.gate_proj)) * _project(h, mlp.up_proj), mlp.down_proj)


def decoder_hidden(lm: nn.Module, input_ids: torch.Tensor, checkpoint_layers: bool = True) -> torch.Tensor:
    """Final-normed hidden states [B, L, H] of right-padded `input_ids` (causal: padding is never seen)."""
    inner = lm.model
    b, t = input_ids.shape
    x = inner.embed_tokens(input_ids)
    positions = torch.arange(t, device=input_ids.device)[None, :].expand(b, t)
    cos, sin = inner.rotary_emb(x, positions)
    cos, sin = cos[:, None], sin[:, None]
    for layer in inner.layers:
        if checkpoint_layers and torch.is_grad_enabled():
            x = checkpoint(_layer, layer, x, cos, sin, use_reentrant=False)
        else:
            x = _layer(layer, x, cos, sin)
    return bi.norm_module(inner.norm, x)
