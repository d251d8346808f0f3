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

SUPPORTED = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


def check_supported(lm: nn.Module) -> None:
    arch = type(lm).__name__
    if arch not in SUPPORTED:
        raise ValueError(f"--batch-invariant supports {', '.join(sorted(SUPPORTED))}, not {arch}")
    bi.check_head_dim(lm.model.layers[0].self_attn.head_dim)


def _eps(norm: nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _project(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    return bi.linear(x, proj.weight, proj.bias)


def _layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    b, t, _ = x.shape
    d = attn.head_dim
    h = bi.rms_norm(x, layer.input_layernorm.weight, _eps(layer.input_layernorm))
    q = _project(h, attn.q_proj).view(b, t, -1, d)
    k = _project(h, attn.k_proj).view(b, t, -1, d)
    v = _project(h, attn.v_proj).view(b, t, -1, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head norm of q and k before the rotation
        q = bi.rms_norm(q, attn.q_norm.weight, _eps(attn.q_norm))
        k = bi.rms_norm(k, attn.k_norm.weight, _eps(attn.k_norm))
    q = bi.apply_rotary(q.transpose(1, 2), cos, sin)
    k = bi.apply_rotary(k.transpose(1, 2), cos, sin)
    x = x + _project(bi.attention(q, k, v, attn.scaling).reshape(b, t, -1), attn.o_proj)
    h = bi.rms_norm(x, layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm))
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
    return bi.rms_norm(x, inner.norm.weight, _eps(inner.norm))
