"""Sampling parameters (SGLang's names and defaults, validated) and batched token sampling.

Logprobs are `log_softmax(logits / T)` of the distribution sampled from,
before top-k/top-p/min-p truncation, as SGLang returns them; temperature 0
means greedy (and logprobs at T = 1). A request with `sampling_seed` draws its
token from a counter-based hash of (seed, position, token id), so its output
does not depend on which other requests share the batch.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

# Every key SGLang 0.5.23 accepts; keys outside this set get a 400.
_SGLANG_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
}
# Accepted by SGLang but not implemented here: allowed only at their neutral value.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
            "beam_width": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
            "stop_regex": None, "logit_bias": None, "custom_params": None, "watermark": None}
_EPS = 1e-6


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: set[int] = dataclasses.field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{name} must be an integer, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{name} must be a number, got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"sampling_params.{name} must be true or false, got {value!r}")
    return value


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate a request's `sampling_params` dict; ValueError says which key is wrong and why."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError("sampling_params must be a JSON object")
    unknown = sorted(set(raw) - _SGLANG_KEYS)
    if unknown:
        raise ValueError(f"unknown sampling_params key(s): {', '.join(unknown)}")
    for key, neutral in _NEUTRAL.items():
        if key in raw and raw[key] is not None and raw[key] != neutral:
            raise ValueError(f"sampling_params.{key} is not supported by the rlyard engine")
    p = SamplingParams()
    if raw.get("max_new_tokens") is not None:
        p.max_new_tokens = _int("max_new_tokens", raw["max_new_tokens"])
        if p.max_new_tokens < 0:
            raise ValueError("sampling_params.max_new_tokens must be >= 0")
    if "temperature" in raw:
        p.temperature = _float("temperature", raw["temperature"])
        if p.temperature < 0:
            raise ValueError("sampling_params.temperature must be >= 0")
    if "top_p" in raw:
        p.top_p = _float("top_p", raw["top_p"])
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if raw.get("top_k") is not None:
        p.top_k = _int("top_k", raw["top_k"])
        if p.top_k == 0 or p.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}")
    if "min_p" in raw:
        p.min_p = _float("min_p", raw["min_p"])
        if not 0.0 <= p.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    stop = raw.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("sampling_params.stop must be a non-empty string or a list of them")
        p.stop = stop
    ids = raw.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise ValueError("sampling_params.stop_token_ids must be a list of token ids")
        p.stop_token_ids = {_int("stop_token_ids", i) for i in ids}
        bad = [i for i in p.stop_token_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of vocabulary (size {vocab_size}): {sorted(bad)}")
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if key in raw and raw[key] is not None:
            setattr(p, key, _bool(key, raw[key]))
    if raw.get("n") is not None:
        p.n = _int("n", raw["n"])
        if not 1 <= p.n <= 64:
            raise ValueError("sampling_params.n must be between 1 and 64")
    if raw.get("sampling_seed") is not None:
        p.sampling_seed = _int("sampling_seed", raw["sampling_seed"])
    if raw.get("stream_interval") is not None:
        _int("stream_interval", raw["stream_interval"])
    return p


# ---- batched sampling ---------------------------------------------------------------------------
_M1, _M2, _M3 = 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D
_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [rows, vocab] from a splitmix-style hash of (seed, position, token id)."""
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _signed(_M1) + positions[:, None] * _signed(_M2) + cols[None, :] * _signed(_M3)
    x = x ^ _srl(x, 30)
    x = x * _signed(0xBF58476D1CE4E5B9)
    x = x ^ _srl(x, 27)
    x = x * _signed(0x94D049BB133111EB)
    x = x ^ _srl(x, 31)
    return (_srl(x, 40).to(torch.float32) + 0.5) / float(1 << 24)


@dataclasses.dataclass
class BatchSampling:
    """Per-row sampling settings of one forward batch, as tensors on the model's device.

    Built once per batch composition: while the same rows keep decoding, `advanced()` moves the
    positions on by one on the device, so a step uploads nothing.
    """

    # All tensors are None when every row is greedy.
    temperature: torch.Tensor | None  # float32, 1.0 for greedy rows
    greedy: torch.Tensor | None  # bool
    top_k: torch.Tensor | None  # int64, vocab for "no limit"
    top_p: torch.Tensor | None  # float32
    min_p: torch.Tensor | None  # float32
    seeded_rows: torch.Tensor | None  # int64 indices of rows with a sampling_seed; None when there are none
    seeds: torch.Tensor | None  # int64, of the seeded rows
    positions: torch.Tensor | None  # int64, index of the token being sampled, of the seeded rows
    needs_truncation: bool
    all_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], vocab: int,
              device: torch.device) -> "BatchSampling":
        greedy = [p.greedy for p in params]
        if all(greedy):  # the common RL-eval / benchmark case: no per-row tensors needed
            return cls(None, None, None, None, None, None, None, None, needs_truncation=False, all_greedy=True)
        top_k = [vocab if (p.top_k < 0 or p.top_k > vocab) else p.top_k for p in params]
        trunc = any(not g and (k < vocab or p.top_p < 1.0 or p.min_p > 0.0)
                    for g, k, p in zip(greedy, top_k, params))
        seeded = [i for i, p in enumerate(params) if p.sampling_seed is not None]

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
        return cls(
            temperature=t([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            greedy=t(greedy, torch.bool), top_k=t(top_k, torch.int64),
            top_p=t([p.top_p for p in params], torch.float32), min_p=t([p.min_p for p in params], torch.float32),
            seeded_rows=t(seeded, torch.int64) if seeded else None,
            seeds=t([params[i].sampling_seed for i in seeded], torch.int64) if seeded else None,
            positions=t([positions[i] for i in seeded], torch.int64) if seeded else None,
            needs_truncation=trunc, all_greedy=False)

    def advanced(self) -> "BatchSampling":
        """The same rows one token later."""
        if self.positions is None:
            return self
        return dataclasses.replace(self, positions=self.positions + 1)


def sample(logits: torch.Tensor, s: BatchSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of float32 `logits` [rows, vocab]; returns (token ids, their logprobs)."""
    if s.all_greedy:  # log_softmax at T=1 of the argmax token, without materialising all logprobs
        best, tokens = logits.max(dim=-1)  # one pass for the token and its logit (first index on ties, as argmax)
        return tokens, best - torch.logsumexp(logits, dim=-1)
    logprobs = torch.log_softmax(logits / s.temperature[:, None], dim=-1)
    allowed = logprobs
    if s.needs_truncation:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        keep = (probs.cumsum(dim=-1) - probs) < s.top_p[:, None]
        keep &= rank < s.top_k[:, None]
        keep &= probs >= s.min_p[:, None] * probs[:, :1]
        keep[:, 0] = True
        allowed = torch.full_like(logprobs, float("-inf")).scatter(1, order, sorted_lp.masked_fill(~keep, float("-inf")))
    # Gumbel-max: argmax(log p + G) samples from p. Seeded rows take hashed noise, the rest fresh noise.
    uniform = torch.rand_like(logits)
    if s.seeded_rows is not None:  # row indices known on the host: no device sync here
        uniform[s.seeded_rows] = seeded_uniform(s.seeds, s.positions, logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    tokens = torch.where(s.greedy, logits.argmax(dim=-1), (allowed + gumbel).argmax(dim=-1))
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
