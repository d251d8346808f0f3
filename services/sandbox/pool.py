"""The warm pool: started sandboxes of the default template, handed out by create() in one step.

Refills happen in quiet moments (POOL_REFILL_DELAY_S after the last
hand-out), so a burst of creates is not slowed by the refill competing for
the CPU. A pooled sandbox is adjusted to the request (limits, quota, time to
live, env, metadata) when handed out.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from services.sandbox import channel
from services.sandbox.box import RUNNING, Box, Resources
from services.sandbox.errors import SandboxError

if TYPE_CHECKING:
    from services.sandbox.manager import Manager

log = logging.getLogger(__name__)

POOL_REFILL_DELAY_S = 0.25


async def _warm(box: Box) -> None:
    try:
        async for _ in channel.exec_stream(box.sock, {"argv": ["/bin/bash", "-c", "true"], "env": {}, "timeout": 10},
                                           guard_s=20):
            pass
    except SandboxError as e:
        log.warning("warm pool: warming %s failed: %s", box.id, e.message)


class WarmPool:
    """Up to `size` running sandboxes of the default template, refilled in the background."""

    def __init__(self, manager: "Manager", size: int) -> None:
        self.m = manager
        self.size = size
        self.boxes: list[Box] = []
        self.wakeup = asyncio.Event()
        self.stopping = False
        self.last_handout = 0.0
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.loop())

    async def stop(self) -> None:
        """Let a launch in progress finish, then destroy every pooled sandbox."""
        self.stopping = True
        self.wakeup.set()
        if self.task:
            try:
                await asyncio.wait_for(self.task, 15)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        await asyncio.gather(*(self.m._destroy(b, "pool drained") for b in list(self.boxes)),
                             return_exceptions=True)

    def __contains__(self, box: Box) -> bool:
        return box in self.boxes

    def remove(self, box: Box) -> None:
        if box in self.boxes:
            self.boxes.remove(box)

    async def take(self, ttl: int, auto_pause: bool, env: dict[str, str], metadata: dict[str, str],
                   resources: Resources) -> Box | None:
        """Hand out a warm sandbox, adjusted to the request; None when the pool is empty."""
        m = self.m
        while self.boxes:
            box = self.boxes.pop(0)
            self.last_handout = time.monotonic()
            self.wakeup.set()
            if box.state != RUNNING:
                continue
            try:
                if resources != box.resources:
                    if m.cgroups.available:
                        m.cgroups.set_limits(box.id, resources.memory_mb, resources.pids, resources.cpu_millis)
                    if resources.disk_mb != box.resources.disk_mb:
                        m.storage.resize(box.id, resources.disk_mb)
            except OSError as e:
                log.warning("pooled sandbox %s could not be adjusted (%s); starting a fresh one", box.id, e)
                await m._destroy(box, "pool adjust failed")
                return None
            now = time.time()
            box.resources, box.created_at, box.expires_at = resources, now, now + ttl
            box.auto_pause, box.env, box.metadata = auto_pause, env, metadata
            m.boxes[box.id] = box
            m._persist(box)
            log.info("created %s from the warm pool", box.id)
            return box
        return None

    async def loop(self) -> None:
        """Keep `pool_size` warm sandboxes of the default template."""
        m = self.m
        template = m.config.default_template
        lowers = [] if m.backend == "process" else [str(m.templates.get(template).rootfs)]
        failures = 0
        while not self.stopping:
            if len(self.boxes) >= self.size or len(m.boxes) >= m.config.max_sandboxes:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            # Refill in quiet moments: right after a hand-out the CPU belongs to the new sandbox's first commands.
            quiet = POOL_REFILL_DELAY_S - (time.monotonic() - self.last_handout)
            if quiet > 0:
                await asyncio.sleep(quiet)
                continue
            try:
                box = await m._launch(template, lowers, m.config.max_timeout_s, False, {}, {}, m._resources(), "",
                                      pooled=True)
                # One command warms the new init (its first fork pays the copy-on-write faults) and the
                # overlay's caches (loader, libc, bash), so the first real command does not.
                await _warm(box)
                failures = 0
            except SandboxError as e:
                failures += 1
                log.warning("warm pool: %s", e.message)
                await asyncio.sleep(min(30.0, 0.5 * 2 ** failures))
