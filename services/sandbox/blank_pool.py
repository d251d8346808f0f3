"""The blank pool: sandboxes started up to the point where their root filesystem is chosen.

A blank has its namespaces, cgroups (joined), writable layer, control socket,
/proc, /dev and /tmp, and its init waits for one request: "attach" with the
read-only layers. The init then mounts the overlay root, moves /proc, /dev and
/tmp into it, pivots, drops its capabilities, installs the seccomp filter and
serves, as a sandbox started in one go does (zygote.py). So any create that the
warm pool cannot serve (another template, a snapshot, the children of a fork)
skips the expensive part of starting: forking, unsharing, the cgroup v1 move.
Blanks are refilled in quiet moments, like the warm pool.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from services.sandbox import channel
from services.sandbox.box import RUNNING, Box
from services.sandbox.errors import SandboxError
from services.sandbox.refill import RefilledPool
from services.sandbox.spawner import SpawnError, pid_start_time

log = logging.getLogger(__name__)

REFILL_BATCH = 8        # blanks started per zygote request while refilling


class BlankPool(RefilledPool):
    """Up to `size` blank sandboxes (namespace backend only), refilled in the background."""

    name = "blank pool"

    def take(self, n: int) -> list[Box]:
        """Up to `n` blanks, removed from the pool (their ids become the new sandboxes' ids)."""
        taken, stale = [], []
        for b in self.boxes[:n]:
            (taken if b.state == RUNNING else stale).append(b)
        del self.boxes[:n]
        for b in stale:  # its init died meanwhile: clean up, do not hand it out
            asyncio.create_task(self.m._destroy(b, "blank sandbox died"))
        if taken or n:
            self.handed_out()
        return taken

    async def attach(self, box: Box, lowers: list[str]) -> None:
        """Give a taken blank its layers; it is a running sandbox when this returns."""
        try:
            await channel.file_op(box.sock, {"op": "attach", "lowers": lowers}, timeout=30)
        except SandboxError as e:
            raise SpawnError(f"blank sandbox {box.id} did not take its root filesystem: {e.message}") from e

    async def _launch(self, count: int) -> None:
        m = self.m
        now = time.time()
        boxes = [Box(id="i" + uuid.uuid4().hex[:19], template="", backend=m.backend, resources=m._resources(),
                     lowers=[], created_at=now, expires_at=now + m.config.max_timeout_s,
                     metadata={"rlyard.pool": "1"}) for _ in range(count)]
        try:
            reqs = []
            for box in boxes:
                req = m._spawn_request(box)
                req.update(blank=True, stage=m.storage.make_stage(box.id))
                reqs.append(req)
            results = await m.spawner.spawn_many(reqs)
        except BaseException:
            await asyncio.shield(asyncio.gather(*(m._destroy(b, "blank start failed") for b in boxes),
                                                return_exceptions=True))
            raise
        for box, res in zip(boxes, results):
            if isinstance(res, int):
                box.pid, box.pid_start, box.state = res, pid_start_time(res) or 0, RUNNING
                m._watch(box)
                m._persist(box)
                self.boxes.append(box)
            else:
                log.warning("blank pool: %s", res)
                await m._destroy(box, "blank start failed")

    def missing(self) -> int:
        m = self.m
        return min(self.size - len(self.boxes),
                   m.config.max_sandboxes - len(m.boxes) - len(m.pool.boxes) - len(self.boxes))

    async def refill(self, missing: int) -> None:
        await self._launch(min(missing, REFILL_BATCH))
