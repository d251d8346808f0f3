"""cgroup v1 control of sandboxes: memory, pids, cpu, cpuacct and freezer groups under `<controller>/rlyard-<tag>/<id>`.

Freezing pauses every process of a sandbox; killing freezes the group, sends
SIGKILL to every member and thaws, so nothing can fork away in between.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")


class CgroupError(Exception):
    pass


class Cgroups:
    """cgroup v1 groups for sandboxes, or `available=False` when the hierarchy is not writable."""

    def __init__(self, root: str = "/sys/fs/cgroup", prefix: str = "rlyard") -> None:
        self.root = Path(root)
        self.prefix = prefix
        self.available = self._probe()

    def _probe(self) -> bool:
        if os.geteuid() != 0:
            return False
        for ctrl in CONTROLLERS:
            base = self.root / ctrl
            if not (base / "cgroup.procs").exists():
                return False
            try:
                (base / self.prefix).mkdir(exist_ok=True)
            except OSError:
                return False
        return True

    def path(self, ctrl: str, sid: str) -> Path:
        return self.root / ctrl / self.prefix / sid

    def paths(self, sid: str) -> list[str]:
        return [str(self.path(c, sid)) for c in CONTROLLERS]

    def create(self, sid: str, memory_mb: int, pids: int, cpu_millis: int) -> list[str]:
        """Make the groups and set the limits; returns the paths the init must join."""
        for ctrl in CONTROLLERS:
            self.path(ctrl, sid).mkdir(exist_ok=True)
        self.set_limits(sid, memory_mb, pids, cpu_millis)
        return self.paths(sid)

    def set_limits(self, sid: str, memory_mb: int, pids: int, cpu_millis: int) -> None:
        mem = self.path("memory", sid)
        limit = str(memory_mb * 1024 * 1024)
        _write(mem / "memory.limit_in_bytes", limit)
        if (mem / "memory.memsw.limit_in_bytes").exists():
            _write(mem / "memory.memsw.limit_in_bytes", limit)
        _write(mem / "memory.swappiness", "0", missing_ok=True)
        _write(self.path("pids", sid) / "pids.max", str(pids))
        cpu = self.path("cpu", sid)
        _write(cpu / "cpu.cfs_period_us", "100000")
        _write(cpu / "cpu.cfs_quota_us", str(max(1000, cpu_millis * 100)))

    def procs(self, sid: str) -> list[int]:
        try:
            text = (self.path("freezer", sid) / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    async def set_frozen(self, sid: str, frozen: bool, timeout: float = 5.0) -> None:
        state = self.path("freezer", sid) / "freezer.state"
        want = "FROZEN" if frozen else "THAWED"
        _write(state, want)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.0002
        while state.read_text().strip() != want:
            if loop.time() > deadline:
                raise CgroupError(f"freezer did not reach {want} within {timeout} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    def frozen(self, sid: str) -> bool:
        try:
            return (self.path("freezer", sid) / "freezer.state").read_text().strip() != "THAWED"
        except OSError:
            return False

    def memory_bytes(self, sid: str) -> int:
        try:
            return int((self.path("memory", sid) / "memory.usage_in_bytes").read_text())
        except OSError:
            return 0

    def cpu_usage_ns(self, sid: str) -> int:
        try:
            return int((self.path("cpuacct", sid) / "cpuacct.usage").read_text())
        except OSError:
            return 0

    def memory_cache_bytes(self, sid: str) -> int:
        try:
            for line in (self.path("memory", sid) / "memory.stat").read_text().splitlines():
                if line.startswith("cache "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    async def kill_all(self, sid: str, timeout: float = 5.0) -> None:
        """SIGKILL every process of the group, frozen first so none escapes by forking."""
        if not self.path("freezer", sid).exists():
            return
        try:
            await self.set_frozen(sid, True, timeout=1.0)
        except (CgroupError, OSError):
            pass
        for _ in range(20):
            pids = self.procs(sid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                _write(self.path("freezer", sid) / "freezer.state", "THAWED")
            except OSError:
                pass
            await asyncio.sleep(0.005)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.procs(sid) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def remove(self, sid: str) -> None:
        """Remove the groups (after kill_all); retried briefly while the kernel releases them."""
        for ctrl in CONTROLLERS:
            p = self.path(ctrl, sid)
            for _ in range(100):
                try:
                    p.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await asyncio.sleep(0.01)
            else:
                log.warning("could not remove cgroup %s", p)

    def remove_prefix(self) -> None:
        """Remove this service's (empty) parent groups."""
        for ctrl in CONTROLLERS:
            try:
                (self.root / ctrl / self.prefix).rmdir()
            except OSError:
                pass

    def list_ids(self) -> set[str]:
        ids: set[str] = set()
        for ctrl in CONTROLLERS:
            base = self.root / ctrl / self.prefix
            if base.is_dir():
                ids.update(d.name for d in base.iterdir() if d.is_dir())
        return ids


def _write(path: Path, value: str, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not missing_ok:
            raise
