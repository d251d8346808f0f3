"""Group-relative advantages (GRPO) and the zero-variance filter."""
from __future__ import annotations

import math
from typing import Sequence

from services.rollout.episode import Episode


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """A_i = (R_i - mean(R)) / (std(R) + eps) within one group (population std)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when every reward of the group is the same (no learning signal)."""
    return len(rewards) < 2 or max(rewards) - min(rewards) <= tol


def assign(groups: list[list[Episode]], eps: float, drop_zero_variance: bool) -> tuple[list[Episode], int]:
    """Set each episode's advantage within its group; return the kept episodes and #dropped groups.

    Failed episodes must already be removed; a group left with fewer than two
    episodes carries no signal and is dropped.
    """
    kept: list[Episode] = []
    dropped = 0
    for group in groups:
        rewards = [e.reward for e in group]
        if len(group) < 2 or (drop_zero_variance and zero_variance(rewards)):
            dropped += 1
            continue
        for ep, adv in zip(group, group_advantages(rewards, eps)):
            ep.advantage = adv
        kept.extend(group)
    return kept, dropped
