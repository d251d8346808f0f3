"""Fixtures for the sandbox-executor tests: one real service process per test module, on free ports,
with its own state directory (templates are shared with the user's cache)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.common.grpc_server import channel
from services.common.proto.rlyard.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc
from services.sandbox.templates import TemplateStore, default_home
from services.common.net import free_port

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hf_rlyard_test_secret_do_not_leak"


def need_namespace_backend() -> None:
    if os.geteuid() != 0:
        pytest.skip("the namespace backend needs root")
    if not TemplateStore().exists("default"):
        pytest.skip("default template missing: python -m services.sandbox template build default")


@dataclass
class Service:
    home: Path
    grpc_port: int
    http_port: int
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)
    log: Path | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(home: Path, *args: str, grpc_port: int | None = None, http_port: int | None = None,
                  extra_env: dict | None = None) -> Service:
    """Start `python -m services.sandbox` and wait until its gRPC health check answers."""
    home.mkdir(parents=True, exist_ok=True)
    templates = home / "templates"
    if not templates.exists():
        templates.symlink_to(default_home() / "templates")
    grpc_port = grpc_port or free_port()
    http_port = http_port or free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_TOKEN=SECRET, AWS_SECRET_ACCESS_KEY=SECRET,
               RLYARD_LOG_LEVEL="INFO", **(extra_env or {}))
    log = home / f"service-{grpc_port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.sandbox", "--host", "127.0.0.1",
                             "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--home", str(home),
                             *args], cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    svc = Service(home, grpc_port, http_port, proc, list(args), log)
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited: {log.read_text()[-2000:]}")
        try:
            with grpc.insecure_channel(svc.target) as ch:
                sandbox_pb2_grpc.SandboxStub(ch).ListTemplates(common_pb2.Empty(), timeout=1)
            import httpx
            httpx.get(svc.url + "/health", timeout=1).raise_for_status()
            return svc
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    svc.stop(signal.SIGKILL)
    raise RuntimeError(f"service did not come up: {log.read_text()[-2000:]}")


def serve(tmp_path_factory, name: str, *args: str):
    """Body of a module-scoped service fixture: a service in a fresh home, stopped and removed after."""
    need_namespace_backend()
    home = tmp_path_factory.mktemp(name)
    svc = start_service(home, *args)
    yield svc
    svc.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    yield from serve(tmp_path_factory, "sbhome", "--on-exit", "kill", "--max-sandboxes", "40", "--exec-timeout", "20")


@pytest.fixture
async def stub(service):
    async with channel(service.target) as ch:
        yield sandbox_pb2_grpc.SandboxStub(ch)


@pytest.fixture
async def box(stub):
    """A fresh running sandbox, killed after the test."""
    info = await stub.Create(sandbox_pb2.CreateSandboxRequest(metadata={"test": "1"}))
    yield info.sandbox_id
    try:
        await stub.Kill(sandbox_pb2.SandboxRef(sandbox_id=info.sandbox_id))
    except grpc.aio.AioRpcError:
        pass


async def sh(stub, sid: str, cmd: str, **kw) -> sandbox_pb2.ExecResult:
    return await stub.Exec(sandbox_pb2.ExecRequest(sandbox_id=sid, shell=cmd, **kw))
