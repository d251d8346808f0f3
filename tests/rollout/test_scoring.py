"""Rewards, group advantages and the zero-variance filter."""
from __future__ import annotations

import pytest

from services.rollout.advantages import assign, group_advantages, zero_variance
from services.rollout.config import RewardConfig
from services.rollout.episode import Episode, TurnRecord
from services.rollout.rewards import score


def _ep(exit_codes=(), timed_out=(), answer="x", violations=0, reward=0.0):
    turns = [TurnRecord("bash", "", 1, "stop", command="c", exit_code=c, timed_out=t)
             for c, t in zip(exit_codes, list(timed_out) + [False] * len(exit_codes))]
    turns += [TurnRecord("none", "", 1, "stop")] * violations
    return Episode(task_id="t", prompt_ids=[1], turns=turns, answer=answer, reward=reward)


def test_reward_shaping():
    cfg = RewardConfig()
    assert score(_ep([0]), True, cfg) == pytest.approx(1.1)
    assert score(_ep([0] * 6), False, cfg) == pytest.approx(0.3)          # bonus capped
    assert score(_ep([1, 2]), False, cfg) == pytest.approx(-0.1)          # two errors
    assert score(_ep([124], [True]), False, cfg) == pytest.approx(-0.1)   # a timeout, not an error
    assert score(_ep([], violations=1, answer=None), False, cfg) == pytest.approx(-0.2)
    custom = RewardConfig(success=2.0, ok_command=0.0, no_answer_penalty=-0.5)
    assert score(_ep([0], answer=None), True, custom) == pytest.approx(1.5)


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1, -1, -1, 1], abs=1e-3)
    assert sum(group_advantages([0.3, 1.2, -0.1])) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]
    assert zero_variance([0.5, 0.5]) and not zero_variance([0.5, 0.6])


def test_assign_drops_zero_variance_groups_only_when_asked():
    g1 = [_ep(reward=1.0), _ep(reward=0.0)]
    g2 = [_ep(reward=0.2), _ep(reward=0.2)]
    kept, dropped = assign([g1, g2], 1e-4, drop_zero_variance=True)
    assert kept == g1 and dropped == 1
    assert g1[0].advantage > 0 > g1[1].advantage
    kept, dropped = assign([g1, g2, [_ep()]], 1e-4, drop_zero_variance=False)
    assert len(kept) == 4 and dropped == 1  # a lone episode has no group to compare with
