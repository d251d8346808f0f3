"""The warm pool: started sandboxes of the default template, handed out by create() in one step.

Refills happen in quiet moments (refill.RefilledPool). A pooled sandbox is
adjusted to the request (limits, quota, time to live, env, metadata) when
handed out.
"""
from __future__ import annotations

import asyncio
import logging
import time

from services.sandbox import channel
from services.sandbox.box import RUNNING, Box, Resources
from services.sandbox.errors import SandboxError
from services.sandbox.refill import RefilledPool

log = logging.getLogger(__name__)


async def _warm(box: Box) -> None:
    try:
        async for _ in channel.exec_stream(box.sock, {"argv": ["/bin/bash", "-c", "true"], "env": {}, "timeout": 10},
                                           guard_s=20):
            pass
    except SandboxError as e:
        log.warning("warm pool: warming %s failed: %s", box.id, e.message)


class WarmPool(RefilledPool):
    """Up to `size` running sandboxes of the default template, refilled in the background."""

    name = "warm pool"

    async def take(self, ttl: int, auto_pause: bool, env: dict[str, str], metadata: dict[str, str],
                   resources: Resources) -> Box | None:
        """Hand out a warm sandbox, adjusted to the request; None when the pool is empty."""
        m = self.m
        while self.boxes:
            box = self.boxes.pop(0)
            self.handed_out()
            if box.state != RUNNING:
                continue
            try:
                m._adjust_resources(box, resources)
            except OSError as e:
                log.warning("pooled sandbox %s could not be adjusted (%s); starting a fresh one", box.id, e)
                await m._destroy(box, "pool adjust failed")
                return None
            now = time.time()
            box.created_at, box.expires_at = now, now + ttl
            box.auto_pause, box.env, box.metadata = auto_pause, env, metadata
            m.boxes[box.id] = box
            # Written right after the hand-over, while the caller's first command is on its way to the init.
            asyncio.get_running_loop().call_soon(m._persist, box)
            log.info("created %s from the warm pool", box.id)
            return box
        return None

    def missing(self) -> int:
        return 0 if len(self.m.boxes) >= self.m.config.max_sandboxes else self.size - len(self.boxes)

    async def refill(self, missing: int) -> None:
        """Start one warm sandbox of the default template."""
        m = self.m
        template = m.config.default_template
        lowers = [] if m.backend == "process" else [str(m.templates.get(template).rootfs)]
        box = await m._launch(template, lowers, m.config.max_timeout_s, False, {}, {}, m._resources(), "",
                              pooled=True)
        # One command warms the new init (its first fork pays the copy-on-write faults) and the
        # overlay's caches (loader, libc, bash), so the first real command does not.
        await _warm(box)
