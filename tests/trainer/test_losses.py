"""The policy loss against a direct, scalar reference computation."""
from __future__ import annotations

import math

import pytest
import torch

from services.trainer.losses import LossSettings, policy_loss, token_weights


def reference_token_loss(logp, rollout, adv, s: LossSettings, ref=None):
    """Textbook formula, one token at a time, in plain Python floats."""
    if s.tis_cap > 0:
        ratio, w = 1.0, min(math.exp(logp - rollout), s.tis_cap)
    else:
        ratio, w = math.exp(logp - rollout), 1.0
    clipped = min(max(ratio, 1 - s.eps_low), 1 + s.eps_high)
    pg = max(-adv * ratio, -adv * clipped)
    dual = False
    if s.dual_clip_c > 1 and adv < 0 and pg > -adv * s.dual_clip_c:
        pg, dual = -adv * s.dual_clip_c, True
    pg *= w
    kl = 0.0
    if ref is not None and s.kl_coef > 0:
        kl = math.exp(ref - logp) - (ref - logp) - 1
        pg += s.kl_coef * kl
    return pg, dual, kl


CASES = [
    # (logp, rollout_logp, advantage): ratios below, inside and far above the clip range
    (-1.0, -1.0, 1.0), (-0.5, -1.0, 1.0), (-2.0, -1.0, 1.0), (-1.0, -3.0, 1.0),
    (-1.0, -1.0, -1.0), (-0.9, -1.0, -0.5), (-2.0, -1.0, -1.0),
    (-0.5, -2.5, -1.0),   # ratio e^2 = 7.4 > c = 3, A < 0: dual-clip bound
    (-0.2, -3.0, -2.0),   # ratio e^2.8: dual-clip bound
    (-0.2, -3.0, 2.0),    # same ratio, A > 0: upper clip, never dual
    (-1.0, -1.2, -1.0),   # ratio 1.22 < c: no dual clip
]


@pytest.mark.parametrize("settings", [
    LossSettings(),
    LossSettings(eps_low=0.1, eps_high=0.3, dual_clip_c=0.0),
    LossSettings(dual_clip_c=2.0),
    LossSettings(tis_cap=2.0),
    LossSettings(kl_coef=0.1),
])
def test_loss_matches_reference(settings):
    logp = torch.tensor([c[0] for c in CASES], dtype=torch.float64)
    rollout = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    adv = torch.tensor([c[2] for c in CASES], dtype=torch.float64)
    ref = logp + 0.3
    out = policy_loss(logp, rollout, adv, settings, ref_logp=ref if settings.kl_coef else None)
    for i, (lp, r, a) in enumerate(CASES):
        want, dual, kl = reference_token_loss(lp, r, a, settings, ref[i].item() if settings.kl_coef else None)
        assert out.loss[i].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (i, settings)
        assert bool(out.dual_clipped[i]) == dual, (i, settings)
        assert out.kl[i].item() == pytest.approx(kl, abs=1e-12)


def test_dual_clip_only_where_advantage_negative():
    s = LossSettings(dual_clip_c=3.0)
    logp = torch.tensor([0.0, 0.0]); rollout = torch.tensor([-3.0, -3.0]); adv = torch.tensor([-1.0, 1.0])
    out = policy_loss(logp, rollout, adv, s)
    assert out.dual_clipped.tolist() == [True, False]
    assert out.loss[0].item() == pytest.approx(3.0)            # -A * c
    assert out.loss[1].item() == pytest.approx(-1.28)          # -A * (1 + eps_high)
    assert out.clipped.tolist() == [False, True]


def test_gradient_zero_when_clipped_and_flows_inside_range():
    s = LossSettings(dual_clip_c=0.0)
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -2.0])  # ratios 1 (inside) and e (clipped, A > 0)
    out = policy_loss(logp, rollout, torch.tensor([1.0, 1.0]), s)
    out.loss.sum().backward()
    assert logp.grad[0].item() == pytest.approx(-1.0)
    assert logp.grad[1].item() == 0.0


def test_aggregation_token_mean_and_seq_mean():
    # two episodes of 1 and 3 masked tokens, per-token loss 1, 2, 2, 2
    loss = torch.tensor([1.0, 2.0, 2.0, 2.0])
    tm = (loss * token_weights([1, 3], [1.0, 1.0], "token_mean", 4, 2, torch.device("cpu"))).sum()
    sm = (loss * token_weights([1, 3], [1.0, 1.0], "seq_mean", 4, 2, torch.device("cpu"))).sum()
    assert tm.item() == pytest.approx(7 / 4)
    assert sm.item() == pytest.approx((1 + 2) / 2)
    weighted = (loss * token_weights([1, 3], [0.5, 1.0], "token_mean", 4, 2, torch.device("cpu"))).sum()
    assert weighted.item() == pytest.approx((0.5 + 6) / 4)


@pytest.mark.parametrize("bad", [dict(eps_low=1.5), dict(dual_clip_c=0.5), dict(aggregation="sum"),
                                 dict(temperature=0.0), dict(kl_coef=-1), dict(tis_cap=-0.1)])
def test_settings_rejected(bad):
    with pytest.raises(ValueError):
        LossSettings(**bad).validate()
