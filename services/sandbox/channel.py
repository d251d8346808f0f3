"""Async client of a sandbox init's control socket: exec with streamed output, and file operations."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator

from services.sandbox import wire
from services.sandbox.errors import SandboxError


@dataclass
class Event:
    """One exec event: kind is "started", "stdout", "stderr" or "end"; `data` or `result` carries it."""
    kind: str
    data: bytes = b""
    pid: int = 0
    result: dict | None = None


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readexactly(wire.HEADER.size)
    kind, length = wire.HEADER.unpack(head)
    if length > wire.MAX_FRAME:
        raise SandboxError("internal", "sandbox init sent an oversized frame")
    return kind, await reader.readexactly(length)


async def _connect(sock: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        return await asyncio.open_unix_connection(sock, limit=1 << 22)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise SandboxError("unavailable", f"the sandbox's init is not answering ({e.strerror}); "
                                          "the sandbox may have died: Get it to see its state") from e


def _request(req: dict, data: bytes | None) -> bytes:
    req = dict(req, data_len=len(data) if data else 0)
    msg = wire.json_frame(wire.REQUEST, req)
    if data:
        msg += wire.frame(wire.DATA, data)
    return msg


async def exec_stream(sock: str, req: dict, stdin: bytes = b"", guard_s: float | None = None
                      ) -> AsyncIterator[Event]:
    """Run a command; yields started, stdout/stderr chunks (head then tail), then end.

    Closing the generator early (client went away) closes the socket, and the init kills the command's tree.
    """
    reader, writer = await _connect(sock)
    expired = False

    def expire() -> None:  # one timer for the whole command, not a wait_for task per frame
        nonlocal expired
        expired = True
        writer.transport.abort()

    timer = None if guard_s is None else asyncio.get_running_loop().call_later(guard_s, expire)
    try:
        writer.write(_request(dict(req, op="exec"), stdin))
        await writer.drain()
        while True:
            try:
                kind, payload = await _read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if expired:
                    raise SandboxError("deadline_exceeded", "the sandbox's init did not finish the command in "
                                                            "time (is the sandbox frozen or out of memory?)") from e
                raise SandboxError("unavailable", "the sandbox ended while the command ran "
                                                  "(killed, or its init died)") from e
            if kind == wire.STARTED:
                yield Event("started", pid=json.loads(payload)["pid"])
            elif kind in (wire.STDOUT, wire.STDOUT_TAIL):
                yield Event("stdout", payload)
            elif kind in (wire.STDERR, wire.STDERR_TAIL):
                yield Event("stderr", payload)
            elif kind == wire.EXIT:
                result = json.loads(payload)
                if "error" in result:
                    raise SandboxError("invalid_argument", result["error"])
                yield Event("end", result=result)
                return
            elif kind == wire.REPLY:
                reply = json.loads(payload)
                raise SandboxError(reply.get("code", "internal"), reply.get("message", "exec failed"))
    finally:
        if timer is not None:
            timer.cancel()
        writer.close()


async def file_op(sock: str, req: dict, data: bytes | None = None, timeout: float = 120.0) -> tuple[dict, bytes]:
    """One file operation; raises SandboxError with the init's error class."""
    reader, writer = await _connect(sock)
    try:
        writer.write(_request(req, data))
        await writer.drain()
        kind, payload = await asyncio.wait_for(_read_frame(reader), timeout)
        reply = json.loads(payload)
        out = b""
        if reply.get("data_len"):
            _, out = await asyncio.wait_for(_read_frame(reader), timeout)
    except asyncio.TimeoutError as e:
        raise SandboxError("deadline_exceeded", "the sandbox's init did not answer in time") from e
    except (asyncio.IncompleteReadError, ConnectionResetError) as e:
        raise SandboxError("unavailable", "the sandbox ended during the file operation") from e
    finally:
        writer.close()
    if not reply.get("ok"):
        code = reply.get("code", "internal")
        raise SandboxError(code, reply.get("message", "file operation failed"))
    return reply, out
