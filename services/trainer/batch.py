"""Turn TrainStep episodes into checked arrays, and plan micro-batches by a token budget.

Everything a batch can get wrong is caught here, before the model is touched:
each problem raises `BatchError` with the gRPC status to answer and a message
naming the episode and the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np

from services.common.packing import unpack


class BatchError(Exception):
    """A rejected batch: `code` is the gRPC status to return, str(self) the reason."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class EpisodeArrays:
    """One checked episode."""

    prompt_ids: np.ndarray        # int64 [P]
    response_ids: np.ndarray      # int64 [R]
    loss_mask: np.ndarray         # bool  [R]
    rollout_logprobs: np.ndarray  # float32 [R]
    advantage: float
    policy_version: int
    weight: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def masked_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _invalid(msg: str) -> BatchError:
    return BatchError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def parse_episode(ep, index: int, vocab_size: int, max_len: int) -> EpisodeArrays:
    """Check one `Episode` message and return its arrays; raise BatchError(INVALID_ARGUMENT)."""
    where = f"episode {index}"
    try:
        prompt = unpack(ep.prompt_ids, expect="int32")
        response = unpack(ep.response_ids, expect="int32")
        mask = unpack(ep.loss_mask, expect="int32")
        logprobs = unpack(ep.rollout_logprobs, expect="float32")
    except ValueError as exc:
        raise _invalid(f"{where}: {exc}") from None
    if len(prompt) == 0:
        raise _invalid(f"{where}: prompt_ids is empty (at least one prompt token is needed "
                       "to predict the first response token)")
    if len(response) == 0:
        raise _invalid(f"{where}: response_ids is empty")
    if not (len(mask) == len(response) == len(logprobs)):
        raise _invalid(f"{where}: response_ids ({len(response)}), loss_mask ({len(mask)}) and "
                       f"rollout_logprobs ({len(logprobs)}) must have the same length")
    if len(prompt) + len(response) > max_len:
        raise _invalid(f"{where}: prompt+response is {len(prompt) + len(response)} tokens, more "
                       f"than the trainer's context of {max_len}")
    for name, ids in (("prompt_ids", prompt), ("response_ids", response)):
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            raise _invalid(f"{where}: {name}[{bad[0]}] = {ids[bad[0]]} is outside the vocabulary "
                           f"[0, {vocab_size})")
    bad = np.flatnonzero((mask != 0) & (mask != 1))
    if bad.size:
        raise _invalid(f"{where}: loss_mask[{bad[0]}] = {mask[bad[0]]}; the mask holds only 0 and 1")
    bad = np.flatnonzero(~np.isfinite(logprobs))
    if bad.size:
        raise _invalid(f"{where}: rollout_logprobs[{bad[0]}] = {logprobs[bad[0]]} is not finite")
    bad = np.flatnonzero((logprobs > 1e-3) & (mask == 1))
    if bad.size:
        raise _invalid(f"{where}: rollout_logprobs[{bad[0]}] = {logprobs[bad[0]]} > 0; a log-prob is <= 0")
    if not np.isfinite(ep.advantage):
        raise _invalid(f"{where}: advantage {ep.advantage} is not finite")
    weight = 1.0 if ep.weight == 0 else float(ep.weight)
    if not np.isfinite(weight) or weight < 0:
        raise _invalid(f"{where}: weight {ep.weight} must be finite and >= 0")
    return EpisodeArrays(prompt_ids=prompt.astype(np.int64), response_ids=response.astype(np.int64),
                         loss_mask=mask.astype(bool), rollout_logprobs=logprobs.astype(np.float32),
                         advantage=float(ep.advantage), policy_version=int(ep.policy_version),
                         weight=weight)


def check_batch(episodes: Sequence[EpisodeArrays], declared: int, policy_version: int) -> None:
    """Checks across the batch: episode count, something to learn from, no future versions."""
    if declared and len(episodes) != declared:
        raise _invalid(f"header announced {declared} episodes, the stream carried {len(episodes)}")
    if not episodes:
        raise _invalid("the batch holds no episodes")
    if sum(e.masked_tokens for e in episodes) == 0:
        raise _invalid("no episode has a loss_mask of 1 anywhere: nothing to train on")
    for i, e in enumerate(episodes):
        if e.policy_version > policy_version:
            raise BatchError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"episode {i} claims policy_version {e.policy_version}, newer than the "
                             f"trainer's {policy_version}")


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices so that each group's padded size (count x longest) fits the budget.

    Longest first, greedy; a sequence longer than the budget gets a group of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and max(longest, n) * (len(current) + 1) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
