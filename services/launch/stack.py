"""Start, health-check and stop the four rlyard services as separate local processes.

The launcher reads the `services:` section of a run config file, starts each
service with `python -m services.<name>`, sends its output to a log file, waits
for its health check (gRPC health for sandbox, trainer and rollout; HTTP
/health_generate for the engine), and stops them all in reverse order: SIGTERM,
then SIGKILL after a grace period. A child is also sent SIGTERM by the kernel if
the launcher itself dies (PR_SET_PDEATHSIG), so no service outlives it. Each child runs in its own process group so
that a Ctrl-C in the terminal reaches the launcher only, which then stops the
children in order.
"""
from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from services.common.grpc_server import check_health
from services.common.model_store import DEFAULT_MODEL, cache_dir
from services.common.net import free_ports

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServiceSpec:
    """How to start and probe one service."""

    name: str
    args: list[str]
    grpc_addr: str | None = None
    http_health: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Endpoints:
    """Where the services listen, as the launcher configured them."""

    sandbox_grpc: str
    sandbox_http: str
    engine_url: str
    trainer_grpc: str
    rollout_grpc: str
    rollout_http: str


def plan(services: dict[str, Any], host: str = "127.0.0.1") -> tuple[list[ServiceSpec], Endpoints]:
    """Turn the `services:` config section into start commands (in start order) and endpoints."""
    model = str(services.get("model") or "SmolLM2-135M-Instruct")
    sb = {"grpc_port": 50051, "http_port": 3000, **(services.get("sandbox") or {})}
    en = {"port": 30000, "device": "cpu", **(services.get("engine") or {})}
    tr = {"port": 50052, "device": "cpu", "checkpoint_dir": "runs/checkpoints", **(services.get("trainer") or {})}
    ro = {"grpc_port": 50053, "http_port": 8080, **(services.get("rollout") or {})}
    ep = Endpoints(
        sandbox_grpc=f"{host}:{sb['grpc_port']}", sandbox_http=f"http://{host}:{sb['http_port']}",
        engine_url=f"http://{host}:{en['port']}", trainer_grpc=f"{host}:{tr['port']}",
        rollout_grpc=f"{host}:{ro['grpc_port']}", rollout_http=f"http://{host}:{ro['http_port']}",
    )
    engine_args = ["--port", str(en["port"]), "--model", model, "--device", str(en["device"])]
    if en.get("dtype"):
        engine_args += ["--dtype", str(en["dtype"])]
    trainer_args = ["--port", str(tr["port"]), "--model", model, "--device", str(tr["device"])]
    for key in ("engine_device", "checkpoint_dir"):
        if tr.get(key):
            trainer_args += [f"--{key.replace('_', '-')}", str(tr[key])]
    specs = [
        ServiceSpec("sandbox", ["--grpc-port", str(sb["grpc_port"]), "--http-port", str(sb["http_port"]),
                                *_extra(sb)], grpc_addr=ep.sandbox_grpc, env=_env(sb)),
        ServiceSpec("engine", engine_args + _extra(en), http_health=f"{ep.engine_url}/health_generate",
                    env=_env(en)),
        ServiceSpec("trainer", trainer_args + _extra(tr), grpc_addr=ep.trainer_grpc, env=_env(tr)),
        ServiceSpec("rollout", ["--grpc-port", str(ro["grpc_port"]), "--http-port", str(ro["http_port"]),
                                "--engine-url", ep.engine_url, "--trainer-addr", ep.trainer_grpc,
                                "--sandbox-addr", ep.sandbox_grpc, *_extra(ro)],
                    grpc_addr=ep.rollout_grpc, env=_env(ro)),
    ]
    return specs, ep


def _env(section: dict[str, Any]) -> dict[str, str]:
    """Extra environment of a service (`env: {CUDA_VISIBLE_DEVICES: "1"}` in its config section)."""
    env = section.get("env") or {}
    if not isinstance(env, dict):
        raise ValueError(f"services.*.env must be a mapping of names to values, got {env!r}")
    return {str(k): str(v) for k, v in env.items()}


def _extra(section: dict[str, Any]) -> list[str]:
    """Free-form extra CLI arguments of a service (`args: [...]` in its config section)."""
    extra = section.get("args") or []
    if not isinstance(extra, list):
        raise ValueError(f"services.*.args must be a list of strings, got {extra!r}")
    return [str(a) for a in extra]


class Stack:
    """The running services; use as an async context manager."""

    def __init__(self, specs: list[ServiceSpec], log_dir: pathlib.Path, python: str = sys.executable) -> None:
        self.specs = specs
        self.log_dir = log_dir
        self.python = python
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoints: Endpoints | None = None

    async def __aenter__(self) -> "Stack":
        try:
            await self.start()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    async def start(self, timeout: float = 600.0) -> None:
        """Start every service, then wait until all are healthy (raises on a crash or timeout)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            logf = open(self.log_dir / f"{spec.name}.log", "ab")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
            cmd = [self.python, "-m", f"services.{spec.name}", *spec.args]
            log.info("starting %s: %s", spec.name, " ".join(cmd[1:]))
            self.procs[spec.name] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                                     preexec_fn=_terminate_with_parent)
            logf.close()
        await asyncio.gather(*(self._wait_healthy(s, timeout) for s in self.specs))

    async def _wait_healthy(self, spec: ServiceSpec, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                proc = self.procs[spec.name]
                if proc.poll() is not None:
                    raise RuntimeError(f"{spec.name} exited with code {proc.returncode} before it was healthy; "
                                       f"last lines of {self.log_dir / (spec.name + '.log')}:\n{self.tail(spec.name)}")
                if await self._healthy(spec, http):
                    log.info("%s healthy after %.1fs", spec.name, time.monotonic() - started)
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{spec.name} not healthy after {timeout:.0f}s; see "
                                       f"{self.log_dir / (spec.name + '.log')}")
                await asyncio.sleep(0.25)

    @staticmethod
    async def _healthy(spec: ServiceSpec, http: httpx.AsyncClient) -> bool:
        if spec.grpc_addr and not await check_health(spec.grpc_addr, timeout=1.0):
            return False
        if spec.http_health:
            try:
                return (await http.get(spec.http_health)).status_code == 200
            except httpx.HTTPError:
                return False
        return True

    def tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a service's log."""
        path = self.log_dir / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def failed(self) -> list[str]:
        """Names of services that exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every service in reverse start order, SIGKILL those still alive after `grace` s."""
        order = [s.name for s in reversed(self.specs) if s.name in self.procs]
        for name in order:
            _signal_group(self.procs[name], signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in order:
            proc = self.procs[name]
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killing it", name, grace)
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def _terminate_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher dies, even by SIGKILL (Linux prctl)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def throwaway_stack(tmp: pathlib.Path, model: str = DEFAULT_MODEL) -> Stack:
    """A CPU stack on free ports with its state under `tmp`, so it runs beside `make run` (tests, benchmarks).

    The sandbox service locks its state folder, so this stack gets its own, sharing the built templates.
    Returns the Stack (not started); its endpoints are in `.endpoints`.
    """
    sb_grpc, sb_http, engine, trainer, ro_grpc, ro_http = free_ports(6)
    sandbox_home = tmp / "sandbox-home"
    sandbox_home.mkdir(parents=True, exist_ok=True)
    if not (sandbox_home / "templates").exists():
        (sandbox_home / "templates").symlink_to(cache_dir() / "templates")
    specs, endpoints = plan({
        "model": model,
        "sandbox": {"grpc_port": sb_grpc, "http_port": sb_http, "args": ["--home", str(sandbox_home)]},
        "engine": {"port": engine, "device": "cpu", "dtype": "float32"},
        "trainer": {"port": trainer, "device": "cpu", "checkpoint_dir": str(tmp / "ckpt")},
        "rollout": {"grpc_port": ro_grpc, "http_port": ro_http, "args": ["--runs-dir", str(tmp / "runs")]},
    })
    stack = Stack(specs, tmp / "logs")
    stack.endpoints = endpoints
    return stack
