"""Start-up recovery: re-adopt the sandboxes a previous service left running, clean up the rest.

A sandbox is re-adopted when its state file names a live init (same pid and
start time) that answers on its control socket, or whose freezer group is
frozen (a paused sandbox cannot answer). Everything else, including warm-pool
sandboxes never handed out and cgroups without a state file, is killed and
removed, so a crash never leaks mounts, cgroups or processes.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.sandbox import channel
from services.sandbox.box import LIVE, PAUSED, RUNNING, Box
from services.sandbox.errors import SandboxError
from services.sandbox.spawner import pid_start_time

if TYPE_CHECKING:
    from services.sandbox.manager import Manager

log = logging.getLogger(__name__)


async def recover(m: "Manager") -> None:
    """Re-adopt or clean up every sandbox found in m's state directory."""
    adopted, lost = 0, 0
    for sid, state in m.storage.read_states().items():
        box = None
        if state is not None:
            try:
                box = Box.from_json(state)
            except (TypeError, KeyError):
                box = None
        if box and box.metadata.get("rlyard.pool") == "1" and box.id not in m.boxes:
            pass  # a warm sandbox never handed out: not worth keeping
        elif box and box.backend == m.backend and box.state in LIVE and box.pid \
                and pid_start_time(box.pid) == box.pid_start:
            frozen = m.cgroups.available and m.cgroups.frozen(sid)
            ok = frozen
            if not frozen:
                try:
                    await channel.file_op(box.sock, {"op": "ping"}, timeout=2.0)
                    ok = True
                except SandboxError:
                    ok = False
            if ok:
                box.state = PAUSED if frozen else RUNNING
                m.boxes[sid] = box
                m._watch(box)
                if box.network is not None:
                    await m._start_egress(box)
                adopted += 1
                continue
        lost += 1
        log.warning("sandbox %s from a previous run is lost or unusable; cleaning it up", sid)
        if box is None:
            box = Box(id=sid, template="", backend=m.backend, resources=m._resources(), lowers=[],
                      created_at=0, expires_at=0)
        await m._destroy(box, "lost at service restart")
    if m.cgroups.available:
        for sid in m.cgroups.list_ids() - set(m.boxes):
            log.warning("removing leaked cgroup rlyard/%s", sid)
            await m.cgroups.kill_all(sid)
            await m.cgroups.remove(sid)
    m._gc_layers()
    if adopted or lost:
        log.info("recovery: %d sandboxes re-adopted, %d cleaned up", adopted, lost)
