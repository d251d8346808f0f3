"""Async client of the sandbox-executor's gRPC API, as the orchestrator uses it.

`SandboxClient` wraps the `rlyard.v1.Sandbox` stub; `SandboxHandle` is one
sandbox bound to that client, the "executor" episodes and verifiers run their
commands through. Every gRPC failure becomes a `SandboxError` carrying the
status code, so an episode can be recorded as failed with a reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.grpc_server import channel
from services.common.proto.rlyard.v1 import sandbox_pb2, sandbox_pb2_grpc

_RPC_SLACK_S = 15.0  # gRPC deadline beyond the command's own timeout


class SandboxError(RuntimeError):
    """A sandbox call failed; `code` is the gRPC status name (e.g. UNAVAILABLE)."""

    def __init__(self, op: str, code: str, detail: str) -> None:
        super().__init__(f"sandbox {op} failed: {code}: {detail}")
        self.op, self.code, self.detail = op, code, detail


@dataclass
class CommandResult:
    """Outcome of one command inside a sandbox."""
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float = 0.0


def _wrap(op: str, exc: grpc.aio.AioRpcError) -> SandboxError:
    return SandboxError(op, exc.code().name, exc.details() or "")


class SandboxClient:
    """The orchestrator's connection to one sandbox-executor."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = channel(target)
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "SandboxClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(self, template: str = "", timeout_s: int = 600,
                     metadata: dict[str, str] | None = None) -> "SandboxHandle":
        req = sandbox_pb2.CreateSandboxRequest(template=template, timeout_s=timeout_s,
                                               metadata=metadata or {})
        try:
            info = await self._stub.Create(req, timeout=120)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("Create", exc) from exc
        return SandboxHandle(self, info.sandbox_id)

    async def fork(self, parent: "SandboxHandle", count: int, timeout_s: int = 0) -> list["SandboxHandle"]:
        req = sandbox_pb2.ForkRequest(sandbox_id=parent.sandbox_id, count=count, timeout_s=timeout_s)
        try:
            reply = await self._stub.Fork(req, timeout=120)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("Fork", exc) from exc
        return [SandboxHandle(self, c.sandbox_id) for c in reply.children]

    async def exec(self, sandbox_id: str, command: str, timeout_s: float,
                   max_output_bytes: int = 0) -> CommandResult:
        req = sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, shell=command, timeout_s=timeout_s,
                                      max_output_bytes=max_output_bytes)
        try:
            r = await self._stub.Exec(req, timeout=timeout_s + _RPC_SLACK_S)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("Exec", exc) from exc
        return CommandResult(exit_code=r.exit_code, stdout=r.stdout.decode("utf-8", "replace"),
                             stderr=r.stderr.decode("utf-8", "replace"), timed_out=r.timed_out,
                             truncated=r.stdout_truncated or r.stderr_truncated,
                             duration_ms=r.duration_ms)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0) -> None:
        req = sandbox_pb2.WriteFileRequest(sandbox_id=sandbox_id, path=path, data=data, mode=mode)
        try:
            await self._stub.WriteFile(req, timeout=60)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("WriteFile", exc) from exc

    async def kill(self, sandbox_id: str) -> None:
        try:
            await self._stub.Kill(sandbox_pb2.SandboxRef(sandbox_id=sandbox_id), timeout=30)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise _wrap("Kill", exc) from exc


class SandboxHandle:
    """One sandbox: run commands, write files, kill."""

    def __init__(self, client: SandboxClient, sandbox_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id

    async def run(self, command: str, timeout_s: float, max_output_bytes: int = 0) -> CommandResult:
        return await self.client.exec(self.sandbox_id, command, timeout_s, max_output_bytes)

    async def write_file(self, path: str, data: bytes, mode: int = 0) -> None:
        await self.client.write_file(self.sandbox_id, path, data, mode)

    async def kill(self) -> None:
        await self.client.kill(self.sandbox_id)
