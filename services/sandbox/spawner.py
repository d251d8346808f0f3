"""The service's handle on the zygote process: start it, batch spawn requests, restart it if it dies."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# The directory holding the `services` package, so the zygote imports the same code as the service.
_CODE_ROOT = str(Path(__file__).resolve().parents[2])
# The only variables the zygote (and so every sandbox) inherits from the service.
_ZYGOTE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class SpawnError(Exception):
    pass


class Spawner:
    """Sends spawn requests to one zygote over its stdin/stdout.

    Requests that arrive while a batch is in flight are gathered into the next batch, so concurrent
    creates are set up in parallel by the zygote instead of one after another.
    """

    MAX_BATCH = 32

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.seq = 0
        self.queue: list[tuple[list[dict], asyncio.Future]] = []
        self.worker: asyncio.Task | None = None

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self.proc is None or self.proc.returncode is not None:
            if self.proc is not None:
                log.warning("zygote exited (%s); starting a new one", self.proc.returncode)
            env = dict(_ZYGOTE_ENV, PYTHONPATH=_CODE_ROOT)
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-S", "-m", "services.sandbox.zygote", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env, cwd="/", limit=1 << 20)
        return self.proc

    async def spawn(self, req: dict, timeout: float = 30.0) -> int:
        """Fork a sandbox init as described by `req`; returns its host pid."""
        res = (await self.spawn_many([req], timeout))[0]
        if isinstance(res, Exception):
            raise res
        return res

    async def spawn_many(self, reqs: list[dict], timeout: float = 60.0) -> list[int | SpawnError]:
        """Fork several inits at once (set up in parallel); a pid or a SpawnError for each."""
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((reqs, fut))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._work(timeout))
        return await fut

    async def _work(self, timeout: float) -> None:
        while self.queue:
            batch: list[tuple[list[dict], asyncio.Future]] = []
            while self.queue and (not batch or sum(len(r) for r, _ in batch) + len(self.queue[0][0])
                                  <= self.MAX_BATCH):
                batch.append(self.queue.pop(0))
            try:
                results = await self._send([req for reqs, _ in batch for req in reqs], timeout)
            except SpawnError as e:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for reqs, fut in batch:
                mine, results = results[:len(reqs)], results[len(reqs):]
                if fut.done():  # the caller gave up: its inits are nobody's, end them
                    _kill_pids([r for r in mine if isinstance(r, int)])
                else:
                    fut.set_result(mine)

    async def _send(self, reqs: list[dict], timeout: float) -> list[int | SpawnError]:
        proc = await self._ensure()
        self.seq += 1
        msg = {"op": "spawn_many", "seq": self.seq, "requests": reqs}
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            await proc.stdin.drain()
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
                if not line:
                    raise SpawnError("zygote exited while spawning; see the service log")
                reply = json.loads(line)
                if reply.get("seq") == self.seq:
                    break
                # A late answer to a batch that timed out: end its inits.
                _kill_pids([int(r["pid"]) for r in reply.get("results") or [] if r.get("ok") and r.get("pid")])
        except (OSError, asyncio.TimeoutError) as e:
            proc.kill()
            raise SpawnError(f"zygote did not answer: {e!r}") from e
        if not reply.get("ok"):
            raise SpawnError(reply.get("error") or "spawn failed")
        return [int(r["pid"]) if r.get("ok") else SpawnError(r.get("error") or "spawn failed")
                for r in reply["results"]]

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 2)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.proc = None


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def pid_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (to tell a re-used pid apart), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2:].split()[19])


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:][:1] not in (b"Z", b"X")
