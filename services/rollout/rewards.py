"""Episode reward: the verifier's outcome plus configurable shaping."""
from __future__ import annotations

from services.rollout.config import RewardConfig
from services.rollout.episode import Episode


def score(ep: Episode, passed: bool, cfg: RewardConfig) -> float:
    """Reward of a played episode whose checks `passed` (or not).

    success if verified; + ok_command per command that exited 0 (summed bonus
    capped at ok_command_cap); + timeout_penalty per timed-out command;
    + error_penalty per command that exited non-zero; + format_penalty once if
    any turn had no valid action; + no_answer_penalty if it never answered.
    """
    ok = sum(1 for t in ep.commands if t.exit_code == 0 and not t.timed_out)
    timeouts = sum(1 for t in ep.commands if t.timed_out)
    errors = sum(1 for t in ep.commands if not t.timed_out and t.exit_code not in (0, None))
    reward = cfg.success if passed else 0.0
    reward += min(ok * cfg.ok_command, cfg.ok_command_cap)
    reward += timeouts * cfg.timeout_penalty + errors * cfg.error_penalty
    if ep.format_violations:
        reward += cfg.format_penalty
    if ep.answer is None:
        reward += cfg.no_answer_penalty
    return reward
