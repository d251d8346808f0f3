"""The gRPC `rlyard.v1.Sandbox` servicer: translates protobuf requests to Manager calls and errors to status codes."""
from __future__ import annotations

import functools
import logging
from typing import Any, AsyncIterator, Callable

import grpc

from services.common.proto.rlyard.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc
from services.common.proto.rlyard.v1 import sandbox_pb2 as pb
from services.sandbox import box as m
from services.sandbox.errors import SandboxError
from services.sandbox.manager import Box, Manager

log = logging.getLogger(__name__)

FULL_NAME = "rlyard.v1.Sandbox"
Ctx = grpc.aio.ServicerContext
_STATE_TO_PB = {
    m.CREATING: sandbox_pb2.SANDBOX_STATE_CREATING, m.RUNNING: sandbox_pb2.SANDBOX_STATE_RUNNING,
    m.PAUSING: sandbox_pb2.SANDBOX_STATE_PAUSING, m.PAUSED: sandbox_pb2.SANDBOX_STATE_PAUSED,
    m.RESUMING: sandbox_pb2.SANDBOX_STATE_RESUMING, m.SNAPSHOTTING: sandbox_pb2.SANDBOX_STATE_SNAPSHOTTING,
    m.FORKING: sandbox_pb2.SANDBOX_STATE_FORKING, m.KILLING: sandbox_pb2.SANDBOX_STATE_KILLING,
    m.KILLED: sandbox_pb2.SANDBOX_STATE_KILLED,
}
_PB_TO_STATE = {v: k for k, v in _STATE_TO_PB.items()}


def info(box: Box) -> sandbox_pb2.SandboxInfo:
    r = box.resources
    return sandbox_pb2.SandboxInfo(
        sandbox_id=box.id, state=_STATE_TO_PB[box.state], template=box.template, backend=box.backend,
        created_at=box.created_at, expires_at=box.expires_at, metadata=box.metadata,
        resources=sandbox_pb2.Resources(memory_mb=r.memory_mb, pids=r.pids, cpu_millis=r.cpu_millis,
                                        disk_mb=r.disk_mb),
        parent_id=box.parent_id, snapshot_kind=box.snapshot_kind, auto_pause=box.auto_pause)


def _result(res: dict, stdout: bytes = b"", stderr: bytes = b"") -> sandbox_pb2.ExecResult:
    return sandbox_pb2.ExecResult(
        exit_code=int(res.get("exit_code", -1)), stdout=stdout, stderr=stderr,
        timed_out=bool(res.get("timed_out")), stdout_truncated=bool(res.get("stdout_truncated")),
        stderr_truncated=bool(res.get("stderr_truncated")), duration_ms=float(res.get("duration_ms", 0)))


def _need_id(sid: str) -> None:
    if not sid:
        raise SandboxError("invalid_argument", "sandbox_id is empty")


def handled(fn: Callable) -> Callable:
    """Map SandboxError to its status code; unexpected errors to INTERNAL, never killing the server."""
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Ctx) -> Any:
        try:
            return await fn(self, request, context)
        except SandboxError as e:
            await context.abort(e.grpc_status, e.message)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__} failed: {e}")
    return wrapper


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, manager: Manager) -> None:
        self.m = manager

    @handled
    async def Create(self, request: pb.CreateSandboxRequest, context: Ctx) -> pb.SandboxInfo:
        r = request.resources
        res = self.m._resources(r.memory_mb, r.pids, r.cpu_millis, r.disk_mb)
        n = request.network
        network = None
        if n.allow_egress:
            network = {"allow_domains": list(n.allow_domains), "allow_cidrs": list(n.allow_cidrs)}
        elif n.allow_domains or n.allow_cidrs:
            raise SandboxError("invalid_argument", "network.allow_domains/allow_cidrs need network.allow_egress=true")
        box = await self.m.create(template=request.template, snapshot_id=request.snapshot_id,
                                  timeout_s=request.timeout_s, auto_pause=request.auto_pause,
                                  env=dict(request.env), metadata=dict(request.metadata), resources=res,
                                  network=network)
        return info(box)

    @handled
    async def Get(self, request: pb.SandboxRef, context: Ctx) -> pb.SandboxInfo:
        _need_id(request.sandbox_id)
        return info(self.m.get(request.sandbox_id))

    @handled
    async def List(self, request: pb.ListSandboxesRequest, context: Ctx) -> pb.ListSandboxesResponse:
        states = [_PB_TO_STATE[s] for s in request.states if s in _PB_TO_STATE]
        return sandbox_pb2.ListSandboxesResponse(
            sandboxes=[info(b) for b in self.m.list(states, dict(request.metadata))])

    def _exec_args(self, request) -> dict:
        _need_id(request.sandbox_id)
        return dict(argv=list(request.argv), shell=request.shell, cwd=request.cwd, env=dict(request.env),
                    stdin=request.stdin, timeout_s=request.timeout_s, max_output_bytes=request.max_output_bytes)

    @handled
    async def Exec(self, request: pb.ExecRequest, context: Ctx) -> pb.ExecResult:
        res = await self.m.run(request.sandbox_id, **self._exec_args(request))
        return _result(res, res["stdout"], res["stderr"])

    async def ExecStream(self, request: pb.ExecRequest, context: Ctx) -> AsyncIterator[pb.ExecEvent]:
        try:
            async for ev in self.m.exec(request.sandbox_id, **self._exec_args(request)):
                if ev.kind == "started":
                    yield sandbox_pb2.ExecEvent(started_pid=ev.pid)
                elif ev.kind == "stdout":
                    yield sandbox_pb2.ExecEvent(stdout=ev.data)
                elif ev.kind == "stderr":
                    yield sandbox_pb2.ExecEvent(stderr=ev.data)
                elif ev.kind == "end":
                    yield sandbox_pb2.ExecEvent(end=_result(ev.result))
        except SandboxError as e:
            await context.abort(e.grpc_status, e.message)

    @handled
    async def WriteFile(self, request: pb.WriteFileRequest, context: Ctx) -> pb.FileInfo:
        _need_id(request.sandbox_id)
        reply, _ = await self.m.file_op(request.sandbox_id, "write", request.data, path=request.path,
                                        mode=request.mode)
        return _file_info(reply["info"])

    @handled
    async def ReadFile(self, request: pb.ReadFileRequest, context: Ctx) -> pb.ReadFileResponse:
        _need_id(request.sandbox_id)
        _, data = await self.m.file_op(request.sandbox_id, "read", path=request.path)
        return sandbox_pb2.ReadFileResponse(data=data)

    @handled
    async def ListDir(self, request: pb.ListDirRequest, context: Ctx) -> pb.ListDirResponse:
        _need_id(request.sandbox_id)
        reply, _ = await self.m.file_op(request.sandbox_id, "list", path=request.path)
        return sandbox_pb2.ListDirResponse(entries=[_file_info(e) for e in reply["entries"]])

    @handled
    async def Remove(self, request: pb.RemoveRequest, context: Ctx) -> common_pb2.Empty:
        _need_id(request.sandbox_id)
        await self.m.file_op(request.sandbox_id, "remove", path=request.path)
        return common_pb2.Empty()

    @handled
    async def UploadTar(self, request: pb.UploadTarRequest, context: Ctx) -> common_pb2.Empty:
        _need_id(request.sandbox_id)
        await self.m.file_op(request.sandbox_id, "untar", request.tar, path=request.path)
        return common_pb2.Empty()

    @handled
    async def DownloadTar(self, request: pb.DownloadTarRequest, context: Ctx) -> pb.DownloadTarResponse:
        _need_id(request.sandbox_id)
        _, data = await self.m.file_op(request.sandbox_id, "tar", path=request.path)
        return sandbox_pb2.DownloadTarResponse(tar=data)

    @handled
    async def Pause(self, request: pb.SandboxRef, context: Ctx) -> pb.SandboxInfo:
        _need_id(request.sandbox_id)
        return info(await self.m.pause(request.sandbox_id))

    @handled
    async def Resume(self, request: pb.SandboxRef, context: Ctx) -> pb.SandboxInfo:
        _need_id(request.sandbox_id)
        return info(await self.m.resume(request.sandbox_id))

    @handled
    async def Snapshot(self, request: pb.SnapshotRequest, context: Ctx) -> pb.SnapshotInfo:
        _need_id(request.sandbox_id)
        meta = await self.m.snapshot(request.sandbox_id, dict(request.metadata))
        return sandbox_pb2.SnapshotInfo(snapshot_id=meta["snapshot_id"], source_sandbox_id=meta["source_sandbox_id"],
                                        kind=meta["kind"], duration_ms=meta["duration_ms"],
                                        created_at=meta["created_at"])

    @handled
    async def Fork(self, request: pb.ForkRequest, context: Ctx) -> pb.ForkResponse:
        _need_id(request.sandbox_id)
        children, ms = await self.m.fork(request.sandbox_id, request.count, request.timeout_s)
        return sandbox_pb2.ForkResponse(children=[info(c) for c in children], kind=m.SNAPSHOT_KIND,
                                        duration_ms=ms)

    @handled
    async def SetTimeout(self, request: pb.SetTimeoutRequest, context: Ctx) -> pb.SandboxInfo:
        _need_id(request.sandbox_id)
        return info(await self.m.set_timeout(request.sandbox_id, request.timeout_s))

    @handled
    async def Kill(self, request: pb.SandboxRef, context: Ctx) -> common_pb2.Empty:
        _need_id(request.sandbox_id)
        await self.m.kill(request.sandbox_id)
        return common_pb2.Empty()

    @handled
    async def ListTemplates(self, request: common_pb2.Empty, context: Ctx) -> pb.ListTemplatesResponse:
        return sandbox_pb2.ListTemplatesResponse(
            templates=[sandbox_pb2.TemplateInfo(name=t.name, path=str(t.rootfs), size_bytes=t.size_bytes,
                                                source=t.source) for t in self.m.templates.list()],
            default_template=self.m.config.default_template)


def _file_info(d: dict) -> sandbox_pb2.FileInfo:
    return sandbox_pb2.FileInfo(name=d["name"], path=d["path"], type=d["type"], size=int(d["size"]),
                                mode=int(d["mode"]))


def add_to(server: Any, manager: Manager) -> SandboxServicer:
    """Register the servicer on a ServiceServer."""
    servicer = SandboxServicer(manager)
    server.add(sandbox_pb2_grpc.add_SandboxServicer_to_server, servicer, FULL_NAME)
    return servicer

