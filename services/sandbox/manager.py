"""The sandbox manager: lifecycle state machine, registry, time to live, snapshot and fork.

Every state change of a sandbox happens under its own asyncio lock, so
concurrent requests see a consistent state (Creating, Running, Pausing,
Paused, Resuming, Snapshotting, Forking, Killing, Killed). All sandboxes
share one event loop; none has a thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

from services.sandbox import backends, channel, exec_helper, recovery
from services.sandbox.box import (FORKING, KILLED, KILLING, PAUSED, PAUSING, RESUMING, RUNNING, SNAPSHOT_KIND,
                                  SNAPSHOTTING, Box, Resources, clean_env)
from services.sandbox.egress import EgressProxy, Policy, proxy_env
from services.sandbox.blank_pool import BlankPool
from services.sandbox.pool import WarmPool
from services.sandbox.cgroups import Cgroups, CgroupError
from services.sandbox.config import SandboxConfig
from services.sandbox.errors import SandboxError, not_found
from services.sandbox.spawner import Spawner, SpawnError, pid_alive, pid_start_time
from services.sandbox.storage import Storage
from services.sandbox.templates import TemplateError, TemplateStore

log = logging.getLogger(__name__)

_TOMBSTONES = 10000


class Manager:
    """Creates, tracks and destroys sandboxes."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.templates = TemplateStore(config.home)
        self.boxes: dict[str, Box] = {}
        self.tombstones: dict[str, Box] = {}
        self.backend = ""
        self.cgroups: Cgroups | None = None
        self.storage: Storage | None = None
        self.spawner = Spawner()
        self.egress = EgressProxy()
        self._ttl_task: asyncio.Task | None = None
        self._create_slots = 0
        self.pool = WarmPool(self, config.pool_size)
        self.blanks = BlankPool(self, config.blank_pool)
        self._lock_file = None
        self.exec_helper = ""  # path of the exec helper the inits start commands through ("" = fork)

    # ---------------------------------------------------------------- start / stop
    async def start(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        try:  # first: a bad --exec-helper must stop the start before anything is mounted or locked
            self.exec_helper = exec_helper.resolve(self.config.exec_helper, self.config.state_dir / "bin")
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        self._lock_state_dir()
        self.backend = backends.choose(self.config.backend)
        # One cgroup folder per state directory, so two services (or a test's) never touch each other's groups.
        tag = hashlib.sha1(str(self.config.state_dir.resolve()).encode()).hexdigest()[:8]
        self.cgroups = Cgroups(prefix=f"rlyard-{tag}")
        if not self.cgroups.available and self.backend != "process":
            log.warning("cgroup v1 (memory, pids, cpu, freezer) is not writable: limits fall back to rlimits "
                        "and pause/resume is unavailable")
        self.storage = Storage(self.config.state_dir, use_tmpfs=os.geteuid() == 0, tag=tag)
        if self.backend != "process":
            try:
                t = self.templates.get(self.config.default_template)
                log.info("default template %r at %s", t.name, t.rootfs)
                owner = os.stat(t.rootfs / "usr").st_uid
                if self.backend == "userns" and owner != os.geteuid():
                    log.warning("template %r is owned by uid %d: in the rootless userns backend only files owned by "
                                "this user (uid %d) are writable inside; import it as this user: "
                                "python -m services.sandbox template import %s <rootfs dir or tar>",
                                t.name, owner, os.geteuid(), t.name)
            except TemplateError as e:
                log.error("%s. Creating sandboxes from it will fail until then.", e)
        if shutil.which("criu"):
            log.info("CRIU is installed but not used: snapshots and forks carry the filesystem only "
                     "(snapshot kind %r)", SNAPSHOT_KIND)
        await self.recover()
        self._ttl_task = asyncio.create_task(self._ttl_loop())
        if self.config.pool_size > 0 and (self.backend == "process"
                                          or self.templates.exists(self.config.default_template)):
            self.pool.start()
        if self.backend == "namespace" and self.cgroups.available:  # a blank's limits are set through cgroups
            self.blanks.start()

    def _lock_state_dir(self) -> None:
        """One service per state directory: a second would adopt (and fight over) the first one's sandboxes."""
        path = self.config.state_dir / "service.lock"
        self._lock_file = open(path, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"another sandbox service is using {self.config.state_dir}; stop it, or give this "
                               "one its own state directory with --home (or RLYARD_HOME)") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"{os.getpid()}\n")
        self._lock_file.flush()

    async def stop(self, kill_all: bool) -> None:
        """Stop background work; kill every sandbox when `kill_all`, else leave them for re-adoption."""
        if self._ttl_task:
            self._ttl_task.cancel()
        await self.pool.stop()
        await self.blanks.stop()
        if kill_all:
            await asyncio.gather(*(self.kill(b.id, reason="service shutdown") for b in list(self.boxes.values())),
                                 return_exceptions=True)
        if not self.boxes:  # nothing left to re-adopt: leave no parent cgroups, socket folder or tmpfs
            if self.cgroups and self.cgroups.available:
                self.cgroups.remove_prefix()
            if self.storage:
                self.storage.remove_socket_dir()
                self.storage.unmount_fork_layers()
        if not kill_all:
            for box in self.boxes.values():
                self._unwatch(box)
            log.info("leaving %d sandboxes for re-adoption at the next start", len(self.boxes))
        await self.spawner.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # ---------------------------------------------------------------- lookups
    def get(self, sid: str) -> Box:
        box = self.boxes.get(sid) or self.tombstones.get(sid)
        if box is None:
            raise not_found(sid)
        return box

    def live(self, sid: str) -> Box:
        box = self.get(sid)
        if box.state == KILLED:
            raise SandboxError("not_found", f"sandbox {sid!r} was killed ({box.killed_reason or 'by request'}); "
                                            "create a new one")
        return box

    def running(self, sid: str) -> Box:
        """The sandbox, if commands can run in it. During a snapshot or fork it is frozen for a moment:
        requests are accepted and the init serves them once it is thawed."""
        box = self.live(sid)
        if box.state not in (RUNNING, SNAPSHOTTING, FORKING):
            hint = "Resume it first" if box.state == PAUSED else "wait and retry"
            raise SandboxError("failed_precondition", f"sandbox {sid!r} is {box.state}, not running; {hint}")
        return box

    def list(self, states: list[str] | None = None, metadata: dict[str, str] | None = None) -> list[Box]:
        pool = list(self.boxes.values())
        if states and KILLED in states:
            pool += list(self.tombstones.values())
        out = []
        for box in pool:
            if states and box.state not in states:
                continue
            if not states and box.state == KILLED:
                continue
            if metadata and any(box.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(box)
        return sorted(out, key=lambda b: b.created_at)

    # ---------------------------------------------------------------- create
    def _resources(self, memory_mb: int = 0, pids: int = 0, cpu_millis: int = 0, disk_mb: int = 0) -> Resources:
        c = self.config
        r = Resources(memory_mb or c.memory_mb, pids or c.pids, cpu_millis or c.cpu_millis, disk_mb or c.disk_mb)
        if r.memory_mb < 16 or r.pids < 8 or r.cpu_millis < 10 or r.disk_mb < 1:
            raise SandboxError("invalid_argument", "resources too small: memory_mb >= 16, pids >= 8, "
                                                   "cpu_millis >= 10, disk_mb >= 1")
        return r

    def _ttl(self, timeout_s: int) -> int:
        t = timeout_s or self.config.timeout_s
        if t > self.config.max_timeout_s:
            raise SandboxError("invalid_argument", f"timeout {t} s exceeds the maximum {self.config.max_timeout_s} s")
        return t

    def _reserve(self, n: int) -> None:
        live = len(self.boxes) + self._create_slots
        if live + n > self.config.max_sandboxes:
            raise SandboxError("resource_exhausted", f"{live} sandboxes are live and the limit is "
                                                     f"{self.config.max_sandboxes}; kill some first "
                                                     "(or start the service with a higher --max-sandboxes)")
        self._create_slots += n

    async def create(self, *, template: str = "", snapshot_id: str = "", timeout_s: int = 0,
                     auto_pause: bool = False, env: dict[str, str] | None = None,
                     metadata: dict[str, str] | None = None, resources: Resources | None = None,
                     network: dict | None = None) -> Box:
        """Create and start a sandbox from a template or a snapshot; `network` enables policy-checked egress."""
        env = clean_env(env, "sandbox env")
        if network is not None:
            if self.backend == "process":
                raise SandboxError("failed_precondition", "egress policies need a network namespace; the process "
                                                          "backend shares the host's network")
            try:
                Policy(**network)
            except (TypeError, ValueError) as e:
                raise SandboxError("invalid_argument", f"bad network policy: {e}") from e
        ttl = self._ttl(timeout_s)
        resources = resources or self._resources()
        template = template or self.config.default_template
        self._reserve(1)
        try:
            box = None
            if not snapshot_id and template == self.config.default_template and network is None:
                # A warm sandbox is of the default template already: no template or snapshot lookup on this path.
                box = await self.pool.take(ttl, auto_pause, env, dict(metadata or {}), resources)
            if box is None:
                template, lowers = self._layers(template, snapshot_id)
                box = await self._launch(template, lowers, ttl, auto_pause, env, dict(metadata or {}), resources, "",
                                         network=network)
        finally:
            self._create_slots -= 1
        return box

    def _layers(self, template: str, snapshot_id: str) -> tuple[str, list[str]]:
        """The template name and read-only layers (top first) a new sandbox is made of."""
        if snapshot_id:
            meta = self.storage.load_snapshot(snapshot_id)
            if meta is None:
                raise SandboxError("not_found", f"snapshot {snapshot_id!r} does not exist; take one with Snapshot")
            return meta["template"], list(meta["lowers"])
        if self.backend == "process":
            return template, []
        try:
            return template, [str(self.templates.get(template).rootfs)]
        except TemplateError as e:
            code = "failed_precondition" if template == self.config.default_template else "not_found"
            raise SandboxError(code, str(e)) from e

    async def _launch(self, template: str, lowers: list[str], ttl: int, auto_pause: bool, env: dict[str, str],
                      metadata: dict[str, str], resources: Resources, parent_id: str, pooled: bool = False,
                      network: dict | None = None) -> Box:
        return (await self._launch_many(1, template, lowers, ttl, auto_pause, env, metadata, resources, parent_id,
                                        pooled, network))[0]

    def _adjust_resources(self, box: Box, resources: Resources) -> None:
        """Apply `resources` to an already started sandbox (one from a pool): cgroup limits and disk quota."""
        if resources != box.resources:
            if self.cgroups.available:
                self.cgroups.set_limits(box.id, resources.memory_mb, resources.pids, resources.cpu_millis)
            if resources.disk_mb != box.resources.disk_mb:
                self.storage.resize(box.id, resources.disk_mb)
            box.resources = resources

    def _spawn_request(self, box: Box) -> dict:
        """Make the sandbox's directories and cgroups; the zygote's spawn request for it."""
        r = box.resources
        paths = self.storage.prepare(box.id, r.disk_mb)
        box.sock, box.base = paths["sock"], paths["base"]
        cgroups: list[str] = []
        rlimits = {"nofile": 65536}
        if self.cgroups.available:
            cgroups = self.cgroups.create(box.id, r.memory_mb, r.pids, r.cpu_millis)
        else:
            rlimits.update(nproc=r.pids, fsize=r.disk_mb * 1024 * 1024)
            if self.backend == "process":
                rlimits["as"] = r.memory_mb * 1024 * 1024 * 4
        return {"backend": self.backend, "lowers": box.lowers, "cgroups": cgroups, "rlimits": rlimits,
                "userns": self.backend == "userns", "tmp_mb": self.config.tmp_mb, "home": self.config.home_dir,
                "hostname": "sandbox", "exec_helper": self.exec_helper, **paths}

    async def _launch_many(self, count: int, template: str, lowers: list[str], ttl: int, auto_pause: bool,
                           env: dict[str, str], metadata: dict[str, str], resources: Resources, parent_id: str,
                           pooled: bool = False, network: dict | None = None,
                           top_layer: "asyncio.Future[str] | None" = None) -> list[Box]:
        """Start `count` sandboxes with the same layers; the zygote forks them all before waiting for any.

        `top_layer` (a fork's sealed layer, still being copied) goes on top of `lowers`: the sandboxes'
        directories and cgroups are made while it is copied, and it is awaited just before the spawn.
        """
        now = time.time()
        # Blank sandboxes (blank_pool.py) only need their layers; the rest are started from scratch.
        blanks = self.blanks.take(count) if not pooled and network is None else []
        boxes = blanks + [Box(id="i" + uuid.uuid4().hex[:19], template=template, backend=self.backend,
                              resources=resources, lowers=[], created_at=now, expires_at=now + ttl)
                          for _ in range(count - len(blanks))]
        for box in boxes:
            box.template, box.lowers, box.created_at, box.expires_at = template, list(lowers), now, now + ttl
            box.auto_pause, box.metadata, box.env, box.parent_id = auto_pause, dict(metadata), dict(env), parent_id
            box.envd_token, box.network = secrets.token_hex(16), network
        if not pooled:
            for box in boxes:
                self.boxes[box.id] = box
        spawned: asyncio.Future | None = None
        async with contextlib.AsyncExitStack() as stack:
            for box in boxes:
                await stack.enter_async_context(box.lock)
            try:
                for box in blanks:
                    self._adjust_resources(box, resources)
                fresh = boxes[len(blanks):]
                reqs = [self._spawn_request(box) for box in fresh]
                for box, req in zip(fresh, reqs):
                    if box.network is not None:
                        req["egress_dir"] = str(await self._start_egress(box))
                if top_layer is not None:
                    layers = [await top_layer, *lowers]
                    for box in boxes:
                        box.lowers = list(layers)
                    for req in reqs:
                        req["lowers"] = list(layers)
                spawned = asyncio.ensure_future(self.spawner.spawn_many(reqs)) if reqs else None
                attached = await asyncio.gather(*(self.blanks.attach(box, box.lowers) for box in blanks),
                                                return_exceptions=True)
                errors = [str(res) for res in attached if isinstance(res, BaseException)]
                for box, res in zip(fresh, await spawned if spawned else []):
                    if isinstance(res, int):
                        box.pid = res
                        box.pid_start = pid_start_time(res) or 0
                        box.state = RUNNING
                        self._watch(box)
                    else:
                        errors.append(str(res))
                if errors:
                    raise SpawnError(errors[0] if len(errors) == 1 else f"{len(errors)} failed, first: {errors[0]}")
                loop = asyncio.get_running_loop()
                for box in boxes:
                    if pooled:
                        box.metadata = {"rlyard.pool": "1"}
                        self.pool.boxes.append(box)
                    # Written right after returning, while the caller's first request is on its way to the init.
                    loop.call_soon(self._persist, box)
            except (SpawnError, OSError, CgroupError) as e:
                log.error("create of %d sandbox(es) failed: %s", count, e)
                for box in boxes:
                    await self._destroy(box, f"create failed: {e}")
                raise SandboxError("internal", f"could not start the sandbox: {e}") from e
            except BaseException:  # cancelled mid-way: leave nothing behind
                if spawned is not None:
                    spawned.cancel()  # the spawner ends the inits of a request nobody waits for
                for box in boxes:
                    await asyncio.shield(self._destroy(box, "create cancelled"))
                raise
        for box in boxes:
            log.log(logging.DEBUG if pooled else logging.INFO, "created %s from %s (%s, pid %d)%s", box.id,
                    template, self.backend, box.pid, " for the warm pool" if pooled else "")
        return boxes

    async def _start_egress(self, box: Box) -> Path:
        directory = self.storage.sockets / f"{box.id}.egress"
        await self.egress.start(box.id, directory, Policy(**box.network))
        return directory

    def _persist(self, box: Box) -> None:
        if box.state == KILLED:  # a deferred write after the kill: the folder is gone, nothing to record
            return
        try:
            self.storage.write_state(box.id, box.to_json())
        except OSError as e:
            log.warning("cannot persist %s: %s", box.id, e)

    # ---------------------------------------------------------------- death watch
    def _watch(self, box: Box) -> None:
        try:
            box.pidfd = os.pidfd_open(box.pid)
        except OSError:
            box.pidfd = -1
            return
        asyncio.get_running_loop().add_reader(box.pidfd, self._on_init_exit, box)

    def _unwatch(self, box: Box) -> None:
        if box.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(box.pidfd)
            os.close(box.pidfd)
            box.pidfd = -1

    def _on_init_exit(self, box: Box) -> None:
        self._unwatch(box)
        if box in self.pool or box in self.blanks:
            self.pool.remove(box)
            self.blanks.remove(box)
            asyncio.create_task(self._destroy(box, "its init process exited"))
            return
        if box.state not in (KILLING, KILLED):
            log.warning("sandbox %s: its init exited unexpectedly; cleaning up", box.id)
            asyncio.create_task(self._kill_quietly(box.id, "its init process exited"))

    async def _kill_quietly(self, sid: str, reason: str) -> None:
        try:
            await self.kill(sid, reason=reason)
        except SandboxError:
            pass  # already gone
        except Exception:  # noqa: BLE001 - a background clean-up must not crash the loop
            log.exception("cleaning up %s", sid)

    # ---------------------------------------------------------------- exec and files
    def exec_env(self, box: Box, extra: dict[str, str] | None) -> dict[str, str]:
        home = box.base if box.backend == "process" else self.config.home_dir
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": home,
               "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash", "LANG": "C.UTF-8", "TERM": "xterm",
               "HOSTNAME": "sandbox"}
        if box.network is not None:
            env.update(proxy_env())
        env.update(self.config.env)
        env.update(box.env)
        env.update(clean_env(extra, "exec env"))
        return env

    async def exec(self, sid: str, *, argv: list[str] | None = None, shell: str = "", cwd: str = "",
                   env: dict[str, str] | None = None, stdin: bytes = b"", timeout_s: float = 0,
                   max_output_bytes: int = 0, detach: bool = False,
                   stdin_open: bool = False, announce: bool = True) -> AsyncIterator[channel.Event]:
        """Run a command; yields channel events (started, stdout, stderr, end).

        With `detach`, the command keeps running if the caller stops listening (envd semantics);
        otherwise closing the stream kills its process tree. Without `announce` there is no "started"
        event (one wake-up less per command; the end event's result carries the pid).
        """
        box = self.running(sid)
        if shell:
            argv = ["/bin/bash", "-c", shell]
        if not argv or not argv[0]:
            raise SandboxError("invalid_argument", "give a command: argv (program and arguments) or shell")
        if any("\x00" in a for a in argv):
            raise SandboxError("invalid_argument", "argv must not contain NUL bytes")
        c = self.config
        timeout = timeout_s if timeout_s and timeout_s > 0 else c.exec_timeout_s
        if timeout > c.max_exec_timeout_s:
            raise SandboxError("invalid_argument", f"timeout_s {timeout} exceeds the maximum {c.max_exec_timeout_s}")
        cap = max_output_bytes or c.output_cap
        if cap > c.max_output_cap:
            raise SandboxError("invalid_argument", f"max_output_bytes {cap} exceeds the maximum {c.max_output_cap}")
        req = {"argv": list(argv), "cwd": cwd, "env": self.exec_env(box, env), "timeout": timeout, "cap": cap,
               "detach": detach, "stdin_open": stdin_open, "announce": announce}
        async for ev in channel.exec_stream(box.sock, req, stdin, guard_s=timeout + 30):
            yield ev

    async def run(self, sid: str, **kw) -> dict:
        """Run a command to completion; returns the exit status with stdout and stderr (head + tail)."""
        out, err = bytearray(), bytearray()
        result: dict = {}
        async for ev in self.exec(sid, announce=False, **kw):
            if ev.kind == "stdout":
                out += ev.data
            elif ev.kind == "stderr":
                err += ev.data
            elif ev.kind == "end":
                result = ev.result
        return dict(result, stdout=bytes(out), stderr=bytes(err), pid=int(result.get("pid") or 0))

    async def file_op(self, sid: str, op: str, data: bytes | None = None, **args) -> tuple[dict, bytes]:
        box = self.running(sid)
        return await channel.file_op(box.sock, dict(args, op=op), data)

    # ---------------------------------------------------------------- pause / resume / timeout
    def _need_freezer(self) -> None:
        if not self.cgroups.available:
            raise SandboxError("failed_precondition", "pause/resume, snapshot and fork need the cgroup freezer "
                                                      "(run the service as root with cgroup v1)")

    async def pause(self, sid: str) -> Box:
        box = self.live(sid)
        self._need_freezer()
        async with box.lock:
            if box.state == PAUSED:
                raise SandboxError("failed_precondition", f"sandbox {sid!r} is already paused")
            if box.state != RUNNING:
                raise SandboxError("failed_precondition", f"sandbox {sid!r} is {box.state}; only a running "
                                                          "sandbox can be paused")
            await self._set_frozen(box, True, self.config.paused_ttl_s)
        return box

    async def resume(self, sid: str, timeout_s: int = 0) -> Box:
        box = self.live(sid)
        self._need_freezer()
        async with box.lock:
            if box.state != PAUSED:
                raise SandboxError("failed_precondition", f"sandbox {sid!r} is {box.state}; only a paused "
                                                          "sandbox can be resumed")
            await self._set_frozen(box, False, self._ttl(timeout_s))
        return box

    async def _set_frozen(self, box: Box, frozen: bool, ttl_s: float) -> None:
        """Pause or resume `box` (lock held, state checked): PAUSING/RESUMING while the freezer
        works, back where it was if that fails; then the new state, its time to live, persisted."""
        before = box.state
        box.state = PAUSING if frozen else RESUMING
        try:
            await self.cgroups.set_frozen(box.id, frozen)
        except (CgroupError, OSError) as e:
            box.state = before
            raise SandboxError("internal", f"{'freezing' if frozen else 'thawing'} failed: {e}") from e
        box.state = PAUSED if frozen else RUNNING
        box.expires_at = time.time() + ttl_s
        self._persist(box)

    async def set_timeout(self, sid: str, timeout_s: int) -> Box:
        box = self.live(sid)
        if timeout_s <= 0:
            raise SandboxError("invalid_argument", "timeout_s must be positive")
        box.expires_at = time.time() + self._ttl(timeout_s)
        self._persist(box)
        return box

    # ---------------------------------------------------------------- snapshot / fork
    async def _sealed_layer(self, box: Box, transient: str, in_memory: bool = False) -> str:
        """Freeze (if running), copy the writable layer into a sealed layer, restore the state."""
        self._need_freezer()
        prior = box.state
        if prior not in (RUNNING, PAUSED):
            raise SandboxError("failed_precondition", f"sandbox {box.id!r} is {prior}; snapshot and fork need a "
                                                      "running or paused sandbox")
        box.state = transient
        try:
            if prior == RUNNING:
                await self.cgroups.set_frozen(box.id, True)
            try:
                return await self.storage.seal(box.id, in_memory)
            finally:
                if prior == RUNNING:
                    await self.cgroups.set_frozen(box.id, False)
        except (OSError, CgroupError) as e:
            raise SandboxError("internal", f"copying the filesystem failed: {e}") from e
        finally:
            box.state = prior

    async def snapshot(self, sid: str, metadata: dict[str, str] | None = None) -> dict:
        box = self.live(sid)
        t0 = time.perf_counter()
        async with box.lock:
            layer = await self._sealed_layer(box, SNAPSHOTTING)
        snap_id = "snap-" + uuid.uuid4().hex[:16]
        meta = {"snapshot_id": snap_id, "source_sandbox_id": sid, "kind": SNAPSHOT_KIND,
                "created_at": time.time(), "template": box.template, "lowers": [layer, *box.lowers],
                "metadata": dict(metadata or {}), "duration_ms": (time.perf_counter() - t0) * 1000}
        self.storage.save_snapshot(snap_id, meta)
        log.info("snapshot %s of %s in %.1f ms", snap_id, sid, meta["duration_ms"])
        return meta

    async def fork(self, sid: str, count: int, timeout_s: int = 0) -> tuple[list[Box], float]:
        box = self.live(sid)
        if not 1 <= count <= 100:
            raise SandboxError("invalid_argument", f"count must be between 1 and 100, got {count}")
        ttl = self._ttl(timeout_s) if timeout_s else max(1, int(box.expires_at - time.time()))
        self._need_freezer()
        if box.state not in (RUNNING, PAUSED):  # checked again under the lock; this spares making children
            raise SandboxError("failed_precondition", f"sandbox {sid!r} is {box.state}; fork needs a running or "
                                                      "paused sandbox")
        self._reserve(count)
        t0 = time.perf_counter()
        children: list[Box] = []

        async def seal() -> str:
            async with box.lock:
                return await self._sealed_layer(box, FORKING, in_memory=True)

        # The copy (a cp process) and the children's set-up (directories, quotas, cgroups) run side by side.
        layer = asyncio.ensure_future(seal())
        try:
            children = await self._launch_many(count, box.template, list(box.lowers), ttl, box.auto_pause, box.env,
                                               box.metadata, box.resources, sid, network=box.network,
                                               top_layer=layer)
        except SandboxError:
            for child in children:
                await self.kill(child.id, reason="fork failed")
            raise
        finally:
            self._create_slots -= count
            if not layer.done():  # the launch failed before needing the layer: let the copy end, then drop it
                await asyncio.gather(layer, return_exceptions=True)
                self._gc_layers()
            elif not layer.cancelled():
                layer.exception()  # retrieved: a failed copy was already reported through the launch
        return children, (time.perf_counter() - t0) * 1000

    def delete_snapshot(self, snap_id: str) -> None:
        if self.storage.load_snapshot(snap_id) is None:
            raise SandboxError("not_found", f"snapshot {snap_id!r} does not exist")
        self.storage.delete_snapshot(snap_id)
        self._gc_layers()

    # ---------------------------------------------------------------- kill
    async def kill(self, sid: str, reason: str = "") -> None:
        box = self.live(sid)
        async with box.lock:
            if box.state == KILLED:
                return
            box.state = KILLING
            await self._destroy(box, reason or "killed by request")
        log.info("killed %s (%s)", sid, reason or "request")

    async def _destroy(self, box: Box, reason: str) -> None:
        """Kill every process, remove cgroups, mounts and files; idempotent."""
        self._unwatch(box)
        if self.cgroups.available:
            await self.cgroups.kill_all(box.id)
        if box.pid and pid_start_time(box.pid) == box.pid_start:
            try:
                os.kill(box.pid, 9)
            except ProcessLookupError:
                pass
            for _ in range(200):
                if not pid_alive(box.pid) or pid_start_time(box.pid) != box.pid_start:
                    break
                await asyncio.sleep(0.005)
        if self.cgroups.available:
            await self.cgroups.remove(box.id)
        if box.network is not None:
            await self.egress.stop(box.id)
        self.storage.release(box.id)
        box.state = KILLED
        box.killed_reason = reason
        box.ended_at = time.time()
        self.pool.remove(box)
        self.blanks.remove(box)
        if self.boxes.pop(box.id, None) is not None:
            self.tombstones[box.id] = box
        while len(self.tombstones) > _TOMBSTONES:
            self.tombstones.pop(next(iter(self.tombstones)))
        self._gc_layers()

    def _gc_layers(self) -> None:
        used = {p for b in self.boxes.values() for p in b.lowers}
        used |= {p for s in self.storage.list_snapshots() for p in s.get("lowers", [])}
        for path in self.storage.layer_paths():
            if path not in used:
                self.storage.drop_layer(path)

    # ---------------------------------------------------------------- time to live
    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for box in list(self.boxes.values()):
                if box.expires_at > now or box.lock.locked():
                    continue
                try:
                    if box.state == RUNNING and box.auto_pause and self.cgroups.available:
                        log.info("sandbox %s reached its time to live: pausing", box.id)
                        await self.pause(box.id)
                    elif box.state in (RUNNING, PAUSED):
                        log.info("sandbox %s reached its time to live: killing", box.id)
                        await self._kill_quietly(box.id, "its time to live ran out")
                except SandboxError as e:
                    log.warning("time to live of %s: %s", box.id, e.message)
                except Exception:  # noqa: BLE001 - the loop must keep running
                    log.exception("time to live of %s", box.id)

    async def recover(self) -> None:
        """Re-adopt sandboxes a previous service left running; clean up everything else."""
        await recovery.recover(self)

    def metrics(self, sid: str) -> dict:
        """Resource use of a sandbox: CPU since creation, memory and writable-layer bytes now."""
        box = self.live(sid)
        cg = self.cgroups
        elapsed = max(1e-3, time.time() - box.created_at)
        cores = max(1.0, box.resources.cpu_millis / 1000)
        out = {"cpu_cores": cores, "memory_total": box.resources.memory_mb << 20,
               "disk_total": box.resources.disk_mb << 20, "disk_used": 0, "memory_used": 0, "memory_cache": 0,
               "cpu_used_pct": 0.0}
        if cg.available:
            out["memory_used"] = cg.memory_bytes(sid)
            out["memory_cache"] = cg.memory_cache_bytes(sid)
            out["cpu_used_pct"] = round(100 * cg.cpu_usage_ns(sid) / 1e9 / elapsed / cores, 2)
        try:
            st = os.statvfs(self.storage.box(sid) / "rw")
            out["disk_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            pass
        return out

    def stats(self) -> dict:
        by_state: dict[str, int] = {}
        for b in self.boxes.values():
            by_state[b.state] = by_state.get(b.state, 0) + 1
        return {"backend": self.backend, "sandboxes": len(self.boxes), "by_state": by_state}
