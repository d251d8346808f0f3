"""The model side of the engine: load a HF decoder, run batched prefill and decode over a slot KV cache.

The forward is built from the HF model's own modules (embeddings, norms,
projections, rotary embedding, MLP), so weights and numerics are the HF
model's; only the attention bookkeeping is ours: every running request owns a
slot of a pre-allocated cache `[slots, kv_heads, capacity, head_dim]` per
layer, prefill writes a padded batch of prompts, and each decode step appends
one token per request and attends over its own prefix.
"""
from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch
import torch.nn.functional as F

from services.common import batch_invariant as bi
from services.common.numerics import project_logits

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF RMSNorm module's math (fp32 normalise, cast, scale) through torch's fused rms_norm."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=bi.norm_eps(norm)).to(x.dtype)


def fuse_rows(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Concatenate parameters along dim 0 and rebind each to a view of its rows.

    One GEMM then replaces several, and weight updates (`param.copy_`) still
    land in the fused tensor because the parameters now live inside it.
    """
    fused = torch.cat([p.data for p in params], dim=0)
    offset = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[offset: offset + rows]
        offset += rows
    return fused


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


LOAD_FORMATS = ("auto", "dummy")


def load_model(path: str | pathlib.Path, device: torch.device, dtype: torch.dtype,
               load_format: str = "auto") -> torch.nn.Module:
    """The folder's model on `device`; load_format "dummy" (as SGLang's) reads only config.json and
    initialises random weights on the device, for benchmarks that replace the weights anyway."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}: use one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=dtype)
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


class ModelRunner:
    """Batched prefill/decode of one causal LM with a per-slot KV cache."""

    def __init__(self, model: torch.nn.Module, max_slots: int = 64, context_len: int | None = None,
                 initial_capacity: int = 256, cuda_graph: bool | None = None, graph_max_len: int = 2048) -> None:
        arch = type(model).__name__
        if arch not in bi.DECODER_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported "
                             f"(supported: {', '.join(sorted(bi.DECODER_ARCHITECTURES))})")
        self.model = model
        cfg = model.config
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.vocab_size = cfg.vocab_size
        self.context_len = min(context_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_slots = max_slots
        self.initial_capacity = min(initial_capacity, self.context_len)
        self.capacity = self.slot_capacity = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self._fuse_projections()
        self.graphs = None
        use_graphs = cuda_graph if cuda_graph is not None else self.device.type == "cuda"
        if use_graphs and self.device.type == "cuda" and (self.device.index or 0) != 0:
            # Seen on 2xH200: graphs captured on cuda:1 replay wrong logits (eager is right there, and
            # graphs on cuda:0 are right). Until that is understood, decode eagerly off device 0.
            log.warning("CUDA graphs are off on %s (only used on device 0): decoding eagerly; to use them, "
                        "start the engine with CUDA_VISIBLE_DEVICES=<its GPU> and --device cuda:0", self.device)
            use_graphs = False
        if use_graphs:
            from services.engine.cuda_graphs import GraphDecoder
            # Graphs bake in the cache's addresses: allocate it whole, once.
            self.initial_capacity = min(graph_max_len, self.context_len)
            self.graphs = GraphDecoder(self)
        self.reset_cache()

    def _fuse_projections(self) -> None:
        """q/k/v and gate/up weights (and biases) of each layer become one tensor each (views keep the names)."""
        if hasattr(self.model, "_rlyard_fused"):  # a second runner on the same model shares the fused tensors
            self.qkv, self.gate_up = self.model._rlyard_fused
            return
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.gate_up: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.model._rlyard_fused = (self.qkv, self.gate_up)
        with torch.no_grad():
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                for mods, out in (((a.q_proj, a.k_proj, a.v_proj), self.qkv), ((m.gate_proj, m.up_proj), self.gate_up)):
                    weight = fuse_rows([mod.weight for mod in mods])
                    has_bias = [mod.bias is not None for mod in mods]
                    if any(has_bias) and not all(has_bias):
                        raise ValueError("mixed biases in fused projections are not supported")
                    bias = fuse_rows([mod.bias for mod in mods]) if all(has_bias) else None
                    out.append((weight, bias))

    @property
    def decode_mode(self) -> str:
        return "cuda_graph" if self.graphs is not None else "eager"

    # ---- KV cache -------------------------------------------------------------------------
    def _alloc(self, slots: int, capacity: int) -> list[torch.Tensor]:
        shape = (slots, self.n_kv, capacity, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def reset_cache(self) -> None:
        """Drop every cached key/value and shrink the cache to its initial size.

        With CUDA graphs the whole cache stays allocated (graphs hold its addresses);
        nothing is reused across requests, so there is nothing else to drop.
        """
        if self.graphs is not None and self.k_cache and self.capacity == self.initial_capacity:
            return
        if self.graphs is not None:
            self.graphs.clear()
        self.k_cache, self.v_cache = [], []
        self.slot_capacity = self.max_slots if self.graphs is not None else min(4, self.max_slots)
        self.capacity = self.initial_capacity
        self.k_cache = self._alloc(self.slot_capacity, self.capacity)
        self.v_cache = self._alloc(self.slot_capacity, self.capacity)

    def ensure_capacity(self, length: int, slots: int = 0) -> None:
        """Grow the cache to hold `slots` slots of `length` positions (doubling; capped by the limits)."""
        if length <= self.capacity and slots <= self.slot_capacity:
            return
        if length > self.context_len:
            raise ValueError(f"{length} positions exceed the context length {self.context_len}")
        if slots > self.max_slots:
            raise ValueError(f"{slots} slots exceed max_slots {self.max_slots}")
        new_len = self.capacity if length <= self.capacity else min(max(length, 2 * self.capacity), self.context_len)
        new_slots = self.slot_capacity if slots <= self.slot_capacity else min(max(slots, 2 * self.slot_capacity),
                                                                               self.max_slots)
        for cache in (self.k_cache, self.v_cache):
            for i, old in enumerate(cache):
                grown = torch.zeros((new_slots, old.shape[1], new_len, old.shape[3]), dtype=old.dtype, device=old.device)
                grown[: self.slot_capacity, :, : self.capacity] = old
                cache[i] = grown
        self.capacity, self.slot_capacity = new_len, new_slots
        if self.graphs is not None:
            self.graphs.clear()  # captured against the old tensors

    # ---- forward --------------------------------------------------------------------------
    # --enable-deterministic-inference: every linear, norm and attention goes through the batch-invariant
    # kernels the trainer's --batch-invariant forward uses (services.common.batch_invariant).
    batch_invariant = False

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return bi.linear(x, weight, bias) if self.batch_invariant else F.linear(x, weight, bias)

    def _norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return bi.norm_module(norm, x) if self.batch_invariant else rms_norm(norm, x)

    def _qkv(self, li: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Fused q/k/v projection and rotary embedding; returns q [b,H,t,D], k and v [b,KV,t,D]."""
        attn = layer.self_attn
        b, t, _ = h.shape
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        qkv = self._linear(h, *self.qkv[li])
        v = qkv[..., nq + nk:].view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before the rotation
            q = self._norm(attn.q_norm, qkv[..., :nq].reshape(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
            k = self._norm(attn.k_norm, qkv[..., nq:nq + nk].reshape(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
            return bi.apply_rotary(q, cos[:, None], sin[:, None]), bi.apply_rotary(k, cos[:, None], sin[:, None]), v
        # q and k rotate together: the HF formula (x*cos + rotate_half(x)*sin), once instead of twice
        qk = qkv[..., : nq + nk].view(b, t, self.n_heads + self.n_kv, self.head_dim).transpose(1, 2)
        qk = bi.apply_rotary(qk, cos[:, None], sin[:, None])
        return qk[:, : self.n_heads], qk[:, self.n_heads:], v

    def _finish_layer(self, li: int, layer: Any, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [b, t, heads * head_dim]: output projection, residual, MLP, residual."""
        o = layer.self_attn.o_proj
        x = x + self._linear(attn_out, o.weight, o.bias)
        gate, up = self._linear(self._norm(layer.post_attention_layernorm, x), *self.gate_up[li]).chunk(2, dim=-1)
        down = layer.mlp.down_proj
        return x + self._linear(layer.mlp.act_fn(gate) * up, down.weight, down.bias)

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of whole right-padded prompts; returns [b, t, heads * head_dim]."""
        b, _, t, _ = q.shape
        if self.batch_invariant:
            return bi.attention(q, k, v, self.scaling).reshape(b, t, -1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                             enable_gqa=self.n_kv != self.n_heads)
        return out.transpose(1, 2).reshape(b, t, -1)

    def _decode_index(self, rows: torch.Tensor, posl: torch.Tensor, length: int) -> Any:
        """What every layer's decode attention needs, made once per step: int32 positions and cache
        rows for the batch-invariant kernel, else the [b, 1, 1, length] mask of visible positions."""
        if self.batch_invariant:
            return posl.to(torch.int32), rows.to(torch.int32)
        return (torch.arange(length, device=self.device)[None, :] <= posl[:, None])[:, None, None, :]

    def _decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor | None,
                          index: Any, length: int) -> torch.Tensor:
        """One query per row over positions [0, length) of cache row rows[i] (or row i), as `index`
        (from _decode_index) says; returns [b, 1, heads * head_dim]. Stock: each kv head's query
        group folds into the query axis."""
        b = q.shape[0]
        if self.batch_invariant:
            positions, kv_rows = index
            return bi.attention(q, kc, vc, self.scaling, positions=positions, kv_rows=kv_rows,
                                kv_len=length).reshape(b, 1, -1)
        keys, values = (kc[:, :, :length], vc[:, :, :length]) if rows is None else \
            (kc[rows, :, :length], vc[rows, :, :length])
        groups = self.n_heads // self.n_kv
        out = F.scaled_dot_product_attention(q.reshape(b, self.n_kv, groups, self.head_dim), keys, values,
                                             attn_mask=index, scale=self.scaling)
        return out.reshape(b, 1, -1)

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run right-padded prompts through the model in one pass, filling their slots from position 0.

        Plain causal attention is exact for right padding: a real token never sees the padding after
        it, and the padding's keys land in the cache past the row's length, where decode (which
        attends only to positions <= its own) never looks before overwriting them. No mask tensor,
        so SDPA can use its flash kernels (GPU and CPU).
        Returns the final hidden states [rows, max_len, hidden] (after the last norm).
        """
        t = max(len(p) for p in prompts)
        self.ensure_capacity(t, max(slots) + 1)
        # non_blocking: a plain host-to-device copy would wait for the stream (a step may still be in flight)
        ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts], dtype=torch.long).to(self.device,
                                                                                           non_blocking=True)
        pos = torch.arange(t, device=self.device)
        slot_idx = torch.tensor(slots).to(self.device, non_blocking=True)
        x = self.embed(ids)
        cos, sin = self.rotary(x, pos[None, :].expand(len(prompts), t))
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(li, layer, self._norm(layer.input_layernorm, x), cos, sin)
            self.k_cache[li][slot_idx, :, :t] = k
            self.v_cache[li][slot_idx, :, :t] = v
            x = self._finish_layer(li, layer, x, self._prefill_attention(q, k, v))
        return self._norm(self.norm, x)

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One step: token i sits at positions[i] of slot slots[i]; returns float32 logits [rows, vocab].

        `tokens` may be a long tensor already on the device (the previous step's samples, not yet on the host).
        """
        b = len(slots)
        length = max(positions) + 1
        self.ensure_capacity(length, max(slots) + 1)
        if self.graphs is not None:
            out = self.graphs.decode(slots, tokens, positions)
            if out is not None:
                return out
        if isinstance(tokens, torch.Tensor):
            tok = tokens.to(self.device, torch.long)
        else:
            tok = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        posl = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        if slots == list(range(slots[0], slots[0] + b)):  # a view of the batch's slots: no gather needed
            return self.decode_rows(tok, posl, slots[0], length)
        slot_idx = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        return self._decode_step(tok, posl, self.k_cache, self.v_cache, slot_idx, length)

    def decode_rows(self, tok: torch.Tensor, posl: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """Decode where row i is slot start+i, attending to positions [0, length): static shapes, no host sync
        (the body CUDA graphs capture)."""
        b = tok.shape[0]
        return self._decode_step(tok, posl, [c[start: start + b] for c in self.k_cache],
                                 [c[start: start + b] for c in self.v_cache], None, length)

    def _decode_step(self, tok: torch.Tensor, posl: torch.Tensor, k_cache: list[torch.Tensor],
                     v_cache: list[torch.Tensor], rows: torch.Tensor | None, length: int) -> torch.Tensor:
        """Row i's token sits at posl[i] of cache row rows[i] (row i itself when rows is None: the caches
        are then views of exactly the batch's slots, read without a gather); returns fp32 logits."""
        put = rows if rows is not None else torch.arange(tok.shape[0], device=self.device)
        index = self._decode_index(put, posl, length)
        x = self.embed(tok)[:, None, :]
        cos, sin = self.rotary(x, posl[:, None])
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(li, layer, self._norm(layer.input_layernorm, x), cos, sin)
            kc, vc = k_cache[li], v_cache[li]
            kc[put, :, posl] = k[:, :, 0]
            vc[put, :, posl] = v[:, :, 0]
            x = self._finish_layer(li, layer, x, self._decode_attention(q, kc, vc, rows, index, length))
        return self.logits(self._norm(self.norm, x)[:, 0])

    # --enable-fp32-lm-head: logits leave the projection in fp32 (see services.common.numerics).
    fp32_lm_head = False

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project_logits(hidden, self.lm_head.weight, fp32=self.fp32_lm_head, batch_invariant=self.batch_invariant)

    @torch.inference_mode()
    def input_logprobs(self, hidden: torch.Tensor, prompt: list[int], start: int,
                       temperature: float) -> list[float | None]:
        """Logprob of each prompt token from `start` on given its prefix (None for token 0)."""
        out: list[float | None] = []
        if start == 0:
            out.append(None)
            start = 1
        if start >= len(prompt):
            return out
        targets = torch.tensor(prompt[start:], device=self.device)
        chunk = max(1, (1 << 24) // self.vocab_size)  # bound the [tokens, vocab] logits in memory
        for lo in range(0, len(targets), chunk):
            h = hidden[start - 1 + lo: start - 1 + lo + chunk]
            lp = torch.log_softmax(self.logits(h) / temperature, dim=-1)
            out.extend(lp.gather(1, targets[lo: lo + chunk, None])[:, 0].tolist())
        return out

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by HF checkpoint name, including the tied `lm_head.weight` alias."""
        params = dict(self.model.named_parameters())
        if "lm_head.weight" not in params and getattr(self.config, "tie_word_embeddings", False):
            params["lm_head.weight"] = self.model.get_input_embeddings().weight
        return params

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

