"""envd routes (the E2B data plane) on the sandbox HTTP port: Connect-protocol process and filesystem RPCs
with the JSON codec, and the `/files` upload/download API.

Requests name their sandbox with the `E2b-Sandbox-Id` header and prove access
with `X-Access-Token` (the `envdAccessToken` returned at create/connect).
"""
from __future__ import annotations

import asyncio
import base64
import datetime as dt
import gzip
import json
import logging
import secrets
import stat
import struct
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.sandbox import box as m
from services.sandbox.errors import SandboxError
from services.sandbox.manager import Manager

log = logging.getLogger(__name__)

CONNECT_JSON = "application/connect+json"
KEEPALIVE_S = 30.0
_CONNECT_HTTP = {"invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403, "not_found": 404,
                 "already_exists": 409, "failed_precondition": 400, "resource_exhausted": 429,
                 "unimplemented": 501, "internal": 500, "unavailable": 503, "deadline_exceeded": 504}
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


def envd_error(exc: SandboxError) -> Response:
    """An error on the envd plane: Connect JSON for RPC paths, E2B's envelope for /files."""
    return JSONResponse({"code": exc.http_status, "message": exc.message}, status_code=exc.http_status)


def connect_error(code: str, message: str) -> Response:
    return JSONResponse({"code": code, "message": message}, status_code=_CONNECT_HTTP.get(code, 500))


async def authorize(manager: Manager, request: Request, call_next) -> Response:
    """Route an envd request: the sandbox must be live and the access token must match."""
    sid = request.headers.get("e2b-sandbox-id", "")
    box = manager.boxes.get(sid)
    if box is None or box.state == m.KILLED:
        return JSONResponse({"code": 502, "message": f"The sandbox {sid} was not found"}, status_code=502)
    token = request.headers.get("x-access-token", "")
    if box.envd_token and not secrets.compare_digest(token, box.envd_token):
        return JSONResponse({"code": 401, "message": "missing or wrong X-Access-Token for this sandbox "
                                                     "(use the envdAccessToken returned by create/connect)"},
                            status_code=401)
    if box.state == m.PAUSED and request.url.path != "/health":
        return JSONResponse({"code": 502, "message": f"The sandbox {sid} is paused; connect to it to resume"},
                            status_code=502)
    return await call_next(request)


def envelope(obj: Any, flags: int = 0) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(data)) + data


def parse_envelope(body: bytes) -> dict:
    if len(body) < 5:
        raise SandboxError("invalid_argument", "empty Connect request")
    flags, length = struct.unpack(">BI", body[:5])
    if flags & 0x01:
        raise SandboxError("invalid_argument", "compressed Connect messages are not supported")
    try:
        return json.loads(body[5:5 + length] or b"{}")
    except ValueError as e:
        raise SandboxError("invalid_argument", f"bad Connect JSON message: {e}") from e


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def entry(info: dict) -> dict:
    out = {"name": info["name"], "type": _TYPES.get(info["type"], "FILE_TYPE_UNSPECIFIED"), "path": info["path"],
           "size": int(info["size"]), "mode": int(info["mode"]), "permissions": stat.filemode(
               int(info["mode"]) | (stat.S_IFDIR if info["type"] == "dir" else stat.S_IFREG)),
           "owner": "root", "group": "root", "modifiedTime": _iso(info.get("mtime", 0))}
    if info.get("target"):
        out["symlinkTarget"] = info["target"]
        out["isSymlink"] = True
    return out


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """(filename, content) of each file part of a multipart/form-data body."""
    boundary = ""
    for piece in content_type.split(";")[1:]:
        k, _, v = piece.strip().partition("=")
        if k.lower() == "boundary":
            boundary = v.strip('"')
    if not boundary:
        raise SandboxError("invalid_argument", "multipart body without a boundary")
    out = []
    for part in body.split(b"--" + boundary.encode())[1:]:
        if part.startswith(b"--"):
            break
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        if content.endswith(b"\r\n"):
            content = content[:-2]
        filename = ""
        for line in head.decode(errors="replace").split("\r\n"):
            if line.lower().startswith("content-disposition"):
                for item in line.split(";")[1:]:
                    k, _, v = item.strip().partition("=")
                    if k == "filename":
                        filename = v.strip('"')
        out.append((filename, content))
    return out


def add_routes(app: FastAPI, manager: Manager) -> None:
    def sid_of(request: Request) -> str:
        return request.headers["e2b-sandbox-id"]

    # ---------------- /files ----------------
    @app.get("/files")
    async def read_file(request: Request) -> Response:
        path = request.query_params.get("path", "")
        _, data = await manager.file_op(sid_of(request), "read", path=path)
        if "gzip" in request.headers.get("accept-encoding", "") and len(data) > 1024:
            return Response(gzip.compress(data), media_type="application/octet-stream",
                            headers={"Content-Encoding": "gzip"})
        return Response(data, media_type="application/octet-stream")

    @app.post("/files")
    async def write_file(request: Request) -> Response:
        sid = sid_of(request)
        body = await request.body()
        ctype = request.headers.get("content-type", "")
        query_path = request.query_params.get("path", "")
        if request.headers.get("content-encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        if ctype.lower().startswith("multipart/form-data"):
            files = parse_multipart(body, ctype)
            if len(files) == 1 and query_path:
                files = [(query_path, files[0][1])]
        else:
            files = [(query_path, body)]
        written = []
        for path, data in files:
            if not path:
                raise SandboxError("invalid_argument", "give the file path in ?path= or as the part's filename")
            reply, _ = await manager.file_op(sid, "write", data, path=path)
            info = reply["info"]
            written.append({"name": info["name"], "type": "file", "path": info["path"]})
        return JSONResponse(written)

    # ---------------- Connect: process ----------------
    @app.post("/process.Process/Start")
    async def process_start(request: Request) -> Response:
        sid = sid_of(request)
        req = parse_envelope(await request.body())
        proc = req.get("process") or {}
        argv = [proc.get("cmd") or "/bin/bash", *(proc.get("args") or [])]
        timeout_ms = request.headers.get("connect-timeout-ms")
        timeout = float(timeout_ms) / 1000 if timeout_ms and timeout_ms.isdigit() and int(timeout_ms) > 0 \
            else manager.config.max_exec_timeout_s
        timeout = min(timeout, manager.config.max_exec_timeout_s)
        keepalive = float(request.headers.get("keepalive-ping-interval") or KEEPALIVE_S)
        events = manager.exec(sid, argv=argv, cwd=proc.get("cwd") or "", env=proc.get("envs") or {},
                              timeout_s=timeout, max_output_bytes=manager.config.max_output_cap, detach=True,
                              stdin_open=bool(req.get("stdin")))
        return StreamingResponse(_process_stream(events, timeout, keepalive), media_type=CONNECT_JSON)

    @app.post("/process.Process/List")
    async def process_list(request: Request) -> Response:
        reply, _ = await manager.file_op(sid_of(request), "processes")
        return JSONResponse({"processes": [
            {"pid": p["pid"], "config": {"cmd": p["argv"][0], "args": p["argv"][1:], "envs": {}, "cwd": p["cwd"]}}
            for p in reply["processes"]]})

    @app.post("/process.Process/SendSignal")
    async def process_signal(request: Request) -> Response:
        body = await _unary_json(request)
        pid = int((body.get("process") or {}).get("pid") or 0)
        sig = _SIGNALS.get(body.get("signal"), 9)
        try:
            await manager.file_op(sid_of(request), "signal", pid=pid, signal=sig)
        except SandboxError as e:
            return connect_error(e.code, e.message)
        return JSONResponse({})

    async def send_stdin(request: Request, pid: int, data: bytes, close: bool) -> Response:
        try:
            await manager.file_op(sid_of(request), "stdin", data, pid=pid, close=close)
        except SandboxError as e:
            return connect_error(e.code, e.message)
        return JSONResponse({})

    @app.post("/process.Process/SendInput")
    async def process_send_input(request: Request) -> Response:
        body = await _unary_json(request)
        try:
            data = base64.b64decode((body.get("input") or {}).get("stdin") or "")
        except ValueError:
            return connect_error("invalid_argument", "input.stdin must be base64")
        return await send_stdin(request, int((body.get("process") or {}).get("pid") or 0), data, close=False)

    @app.post("/process.Process/CloseStdin")
    async def process_close_stdin(request: Request) -> Response:
        body = await _unary_json(request)
        return await send_stdin(request, int((body.get("process") or {}).get("pid") or 0), b"", close=True)

    for name in ("Connect", "StreamInput", "Update"):
        app.post(f"/process.Process/{name}")(_unimplemented(f"process.Process/{name}"))

    # ---------------- Connect: filesystem ----------------
    async def fs_call(request: Request, op: str, **args) -> dict:
        reply, _ = await manager.file_op(sid_of(request), op, **args)
        return reply

    @app.post("/filesystem.Filesystem/Stat")
    async def fs_stat(request: Request) -> Response:
        body = await _unary_json(request)
        return await _rpc(lambda: fs_call(request, "stat", path=body.get("path", "")),
                          lambda r: {"entry": entry(r["info"])})

    @app.post("/filesystem.Filesystem/ListDir")
    async def fs_list(request: Request) -> Response:
        body = await _unary_json(request)
        return await _rpc(lambda: fs_call(request, "list", path=body.get("path", ""), depth=body.get("depth") or 1),
                          lambda r: {"entries": [entry(e) for e in r["entries"]]})

    @app.post("/filesystem.Filesystem/MakeDir")
    async def fs_mkdir(request: Request) -> Response:
        body = await _unary_json(request)

        async def call() -> dict:
            r = await fs_call(request, "mkdir", path=body.get("path", ""))
            if not r["created"]:
                raise SandboxError("already_exists", f"{body.get('path')} already exists")
            return r
        return await _rpc(call, lambda r: {"entry": entry(r["info"])})

    @app.post("/filesystem.Filesystem/Remove")
    async def fs_remove(request: Request) -> Response:
        body = await _unary_json(request)
        return await _rpc(lambda: fs_call(request, "remove", path=body.get("path", "")), lambda r: {})

    @app.post("/filesystem.Filesystem/Move")
    async def fs_move(request: Request) -> Response:
        body = await _unary_json(request)
        return await _rpc(lambda: fs_call(request, "rename", path=body.get("source", ""),
                                          dest=body.get("destination", "")),
                          lambda r: {"entry": entry(r["info"])})

    for name in ("WatchDir", "CreateWatcher", "GetWatcherEvents", "RemoveWatcher"):
        app.post(f"/filesystem.Filesystem/{name}")(_unimplemented(f"filesystem.Filesystem/{name}"))


async def _unary_json(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise SandboxError("invalid_argument", f"bad Connect JSON request: {e}") from e
    return body if isinstance(body, dict) else {}


async def _rpc(call, shape) -> Response:
    try:
        return JSONResponse(shape(await call()))
    except SandboxError as e:
        return connect_error(e.code, e.message)


def _unimplemented(name: str):
    async def handler(request: Request) -> Response:
        return connect_error("unimplemented", f"{name} is not implemented by rlyard's sandbox service")
    return handler


async def _process_stream(events: AsyncIterator, timeout: float, keepalive: float) -> AsyncIterator[bytes]:
    """Connect server-stream of process events; a timed-out command ends with deadline_exceeded."""
    queue: asyncio.Queue = asyncio.Queue()

    async def produce() -> None:
        try:
            async for ev in events:
                await queue.put(ev)
            await queue.put(None)
        except SandboxError as e:
            await queue.put(e)
        except Exception as e:  # noqa: BLE001 - surfaced to the client as an internal error
            log.exception("process stream failed")
            await queue.put(SandboxError("internal", str(e)))

    task = asyncio.create_task(produce())
    try:
        while True:
            try:
                ev = await asyncio.wait_for(queue.get(), keepalive)
            except asyncio.TimeoutError:
                yield envelope({"event": {"keepalive": {}}})
                continue
            if ev is None:
                yield envelope({}, flags=0x02)
                return
            if isinstance(ev, SandboxError):
                yield envelope({"error": {"code": ev.code, "message": ev.message}}, flags=0x02)
                return
            if ev.kind == "started":
                yield envelope({"event": {"start": {"pid": ev.pid}}})
            elif ev.kind in ("stdout", "stderr"):
                yield envelope({"event": {"data": {ev.kind: base64.b64encode(ev.data).decode()}}})
            elif ev.kind == "end":
                res = ev.result
                if res.get("timed_out"):
                    yield envelope({"error": {"code": "deadline_exceeded", "message":
                                              f"command timed out after {timeout:g} s; its process tree "
                                              "was killed"}}, flags=0x02)
                    return
                code = int(res["exit_code"])
                status = f"signal: {code - 128}" if code > 128 else f"exit status {code}"
                yield envelope({"event": {"end": {"exitCode": code, "exited": code <= 128, "status": status}}})
    finally:
        task.cancel()
