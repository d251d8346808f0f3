"""Play GRPO groups: a sandbox per episode (forked from one prepared sandbox), verify, score.

An episode that cannot be played (sandbox error, engine timeout, malformed
reply, broken task setup) comes back with `failed` set to its reason instead
of raising, so one bad episode never stops a step.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from services.rollout.config import RunConfig
from services.rollout.episode import Episode, EpisodeFailed, EpisodeRunner
from services.rollout.rewards import score
from services.rollout.sandbox_client import SandboxClient, SandboxError, SandboxHandle
from services.rollout.tasks import Task
from services.rollout.verify import SetupFailed, prepare, verify

log = logging.getLogger(__name__)

_FORK_UNSUPPORTED = {"UNIMPLEMENTED", "FAILED_PRECONDITION"}


def failed_episode(task: Task, reason: str, detail: str) -> Episode:
    return Episode(task_id=task.id, prompt_ids=[], failed=reason, error=detail[:1000])


class GroupPlayer:
    """Plays groups of episodes for one run."""

    def __init__(self, cfg: RunConfig, runner: EpisodeRunner, sandboxes: SandboxClient,
                 limit: asyncio.Semaphore) -> None:
        self.cfg = cfg
        self.runner = runner
        self.sandboxes = sandboxes
        self.limit = limit
        self.fork_supported = cfg.sandbox.fork

    async def _new_prepared(self, task: Task) -> SandboxHandle:
        sb = await self.sandboxes.create(self.cfg.sandbox.template, self.cfg.sandbox.timeout_s,
                                         {"rlyard_task": task.id})
        try:
            await prepare(task, sb)
        except BaseException:
            await _quiet_kill(sb)
            raise
        return sb

    async def _sandboxes(self, task: Task, n: int) -> list[SandboxHandle]:
        """n sandboxes holding the task's setup: one prepared and forked n times when possible."""
        if n == 1 or not self.fork_supported:
            return list(await asyncio.gather(*(self._new_prepared(task) for _ in range(n))))
        parent = await self._new_prepared(task)
        try:
            return await self.sandboxes.fork(parent, n)
        except SandboxError as exc:
            if exc.code not in _FORK_UNSUPPORTED:
                raise
            log.warning("sandbox cannot fork (%s); creating each episode's sandbox instead", exc)
            self.fork_supported = False
            return list(await asyncio.gather(*(self._new_prepared(task) for _ in range(n))))
        finally:
            await _quiet_kill(parent)

    async def play_group(self, task: Task, n: int, greedy: bool = False,
                         on_episode: Optional[Callable[[Episode], None]] = None) -> list[Episode]:
        """Play `n` episodes of `task`; failed ones carry their reason."""
        try:
            boxes = await self._sandboxes(task, n)
        except SetupFailed as exc:
            eps = [failed_episode(task, "setup_failed", str(exc)) for _ in range(n)]
        except SandboxError as exc:
            eps = [failed_episode(task, "sandbox_error", str(exc)) for _ in range(n)]
        else:
            eps = list(await asyncio.gather(*(self._one(task, sb, greedy, on_episode) for sb in boxes)))
            return eps
        for ep in eps:
            if on_episode:
                on_episode(ep)
        return eps

    async def _one(self, task: Task, sb: SandboxHandle, greedy: bool,
                   on_episode: Optional[Callable[[Episode], None]]) -> Episode:
        try:
            async with self.limit:
                ep = await self.runner.play(task.id, task.instruction, sb, self.cfg.sampling, greedy)
                verdict = await verify(task, ep.answer, sb)
            ep.success = verdict.passed
            ep.verdict_notes = verdict.notes
            ep.reward = score(ep, verdict.passed, self.cfg.reward)
        except EpisodeFailed as exc:
            ep = failed_episode(task, exc.reason, exc.detail)
        except SandboxError as exc:
            ep = failed_episode(task, "sandbox_error", str(exc))
        except Exception as exc:  # a bug must not kill the run; it is recorded with its type
            log.exception("episode of %s crashed", task.id)
            ep = failed_episode(task, "internal_error", f"{type(exc).__name__}: {exc}")
        finally:
            await _quiet_kill(sb)
        if on_episode:
            on_episode(ep)
        return ep


async def _quiet_kill(sb: SandboxHandle) -> None:
    try:
        await asyncio.shield(sb.kill())
    except (SandboxError, asyncio.CancelledError) as exc:
        log.debug("could not kill sandbox %s: %s", sb.sandbox_id, exc)
