"""What the warm pool and the blank pool share: a list of ready sandboxes, refilled in quiet moments.

A refill waits REFILL_DELAY_S after the last hand-out, so a burst of creates
is not slowed by the refill competing for the CPU; a failing refill backs off
exponentially (creates fall back to a full start meanwhile) and never stops.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from services.sandbox.box import Box

if TYPE_CHECKING:
    from services.sandbox.manager import Manager

log = logging.getLogger(__name__)

REFILL_DELAY_S = 0.25


class RefilledPool:
    """Up to `size` ready sandboxes kept by a background task; subclasses say how many are missing
    and how to start them."""

    name = "pool"

    def __init__(self, manager: "Manager", size: int) -> None:
        self.m = manager
        self.size = size
        self.boxes: list[Box] = []
        self.wakeup = asyncio.Event()
        self.stopping = False
        self.last_handout = 0.0
        self.task: asyncio.Task | None = None

    def missing(self) -> int:
        """How many sandboxes the pool should start now (<= 0: none)."""
        raise NotImplementedError

    async def refill(self, missing: int) -> None:
        """Start up to `missing` sandboxes into `self.boxes`."""
        raise NotImplementedError

    def start(self) -> None:
        if self.size > 0:
            self.task = asyncio.create_task(self.loop())

    async def stop(self) -> None:
        """Let a refill in progress finish, then destroy every pooled sandbox."""
        self.stopping = True
        self.wakeup.set()
        if self.task:
            try:
                await asyncio.wait_for(self.task, 15)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        await asyncio.gather(*(self.m._destroy(b, f"{self.name} drained") for b in list(self.boxes)),
                             return_exceptions=True)

    def __contains__(self, box: Box) -> bool:
        return box in self.boxes

    def remove(self, box: Box) -> None:
        if box in self.boxes:
            self.boxes.remove(box)

    def handed_out(self) -> None:
        self.last_handout = time.monotonic()
        self.wakeup.set()

    async def loop(self) -> None:
        failures = 0
        while not self.stopping:
            missing = self.missing()
            if missing <= 0:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            # Right after a hand-out the CPU belongs to the new sandbox's first commands.
            quiet = REFILL_DELAY_S - (time.monotonic() - self.last_handout)
            if quiet > 0:
                await asyncio.sleep(quiet)
                continue
            try:
                await self.refill(missing)
                failures = 0
            except Exception as e:  # noqa: BLE001 - the refill must keep going; creates fall back meanwhile
                failures += 1
                log.warning("%s: %s", self.name, getattr(e, "message", None) or e)
                await asyncio.sleep(min(30.0, 0.5 * 2 ** failures))
