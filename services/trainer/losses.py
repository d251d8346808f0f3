"""The clipped policy-gradient loss (PPO/GRPO family), per token, with its metrics.

Algorithm-blind: advantages arrive with the batch. Per masked response token

    ratio   = exp(logp - logp_old)
    pg      = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    pg      = min(pg, -A * c)                 only where A < 0 and c > 1 (dual-clip)
    loss_t  = w_is * pg + kl_coef * k3(logp, logp_ref)

`logp_old` is the rollout engine's log-prob. With a truncated importance
weight (tis_cap > 0) the ratio is taken against the trainer's own detached
log-prob instead and the rollout/trainer mismatch is corrected by
`w_is = min(exp(logp_trainer - logp_rollout), tis_cap)` (decoupled PPO).
Aggregation: token-mean over every masked token of the batch, or seq-mean
(mean over episodes of each episode's token mean). Episode weights multiply.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class LossSettings:
    """Loss knobs of one step (defaults come from the trainer's flags)."""

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float = 3.0
    aggregation: str = "token_mean"
    kl_coef: float = 0.0
    tis_cap: float = 0.0
    lr: float = 1e-6
    temperature: float = 1.0

    def validate(self) -> None:
        """Raise ValueError with the offending field when a setting is out of range."""
        if not (0.0 <= self.eps_low < 1.0):
            raise ValueError(f"loss.eps_low must be in [0, 1), got {self.eps_low}")
        if not (0.0 <= self.eps_high):
            raise ValueError(f"loss.eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip_c != 0.0 and not self.dual_clip_c > 1.0:
            raise ValueError(f"loss.dual_clip_c must be 0 (off) or > 1, got {self.dual_clip_c}")
        if self.aggregation not in ("token_mean", "seq_mean"):
            raise ValueError(f"loss.aggregation must be 'token_mean' or 'seq_mean', got {self.aggregation!r}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {self.kl_coef}")
        if not self.tis_cap >= 0.0:
            raise ValueError(f"loss.tis_cap must be >= 0 (0 = off), got {self.tis_cap}")
        if not (self.lr >= 0.0 and self.lr < 1.0):
            raise ValueError(f"loss.lr must be in [0, 1), got {self.lr}")
        if not self.temperature > 0.0:
            raise ValueError(f"loss.temperature must be > 0, got {self.temperature}")

    def merged(self, **overrides: float | str | None) -> "LossSettings":
        """A copy with the given non-None fields replaced."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class TokenLoss:
    """Per-token results of `policy_loss` (all 1-D over the tokens passed in)."""

    loss: torch.Tensor          # per-token loss, already importance-weighted, KL included
    clipped: torch.Tensor       # bool: the clipped branch was taken (ratio outside the range)
    dual_clipped: torch.Tensor  # bool: the dual-clip bound was taken
    kl: torch.Tensor            # per-token k3 KL (zeros when no reference)


def policy_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                settings: LossSettings, ref_logp: torch.Tensor | None = None) -> TokenLoss:
    """Per-token clipped-ratio loss; every argument is 1-D over the same tokens."""
    if settings.tis_cap > 0:
        old = logp.detach()
        is_weight = torch.exp(logp.detach() - rollout_logp).clamp(max=settings.tis_cap)
    else:
        old = rollout_logp
        is_weight = None
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1.0 - settings.eps_low, 1.0 + settings.eps_high)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * clipped_ratio
    pg = torch.maximum(unclipped_loss, clipped_loss)
    clipped = clipped_loss > unclipped_loss
    dual = torch.zeros_like(clipped)
    if settings.dual_clip_c > 1.0:
        bound = -advantages * settings.dual_clip_c
        dual = (advantages < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
    if is_weight is not None:
        pg = pg * is_weight
    if ref_logp is not None and settings.kl_coef > 0:
        log_r = ref_logp - logp
        kl = torch.exp(log_r) - log_r - 1.0
        pg = pg + settings.kl_coef * kl
    else:
        kl = torch.zeros_like(pg)
    return TokenLoss(loss=pg, clipped=clipped, dual_clipped=dual, kl=kl)


def token_weights(lengths: list[int], episode_weights: list[float], aggregation: str,
                  total_tokens: int, total_episodes: int, device: torch.device) -> torch.Tensor:
    """Factor of each masked token in the batch loss, so that summing `loss * factor`
    over every micro-batch gives the token-mean (or seq-mean) of the whole batch.

    `lengths` are the masked-token counts of the episodes of one micro-batch, in order.
    """
    parts = []
    for n, w in zip(lengths, episode_weights):
        if aggregation == "token_mean":
            f = w / max(total_tokens, 1)
        else:
            f = w / (max(n, 1) * max(total_episodes, 1))
        parts.append(torch.full((n,), f, dtype=torch.float32, device=device))
    return torch.cat(parts) if parts else torch.zeros(0, device=device)
