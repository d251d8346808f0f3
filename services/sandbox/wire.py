"""The framing spoken on a sandbox's control socket, between the service and the sandbox's init.

A frame is one type byte, a 4-byte big-endian length, then the payload.
Standard library only (the init imports it).
"""
from __future__ import annotations

import json
import struct

HEADER = struct.Struct(">cI")
MAX_FRAME = 1 << 30

REQUEST = b"J"     # JSON request header (service -> init)
DATA = b"B"        # raw bytes: stdin, file content, tar (both ways)
REPLY = b"R"       # JSON reply to a file operation
STARTED = b"P"     # JSON {"pid": N}: the command started
STDOUT = b"O"      # a chunk of standard output (head part)
STDERR = b"E"      # a chunk of standard error (head part)
STDOUT_TAIL = b"o"  # the kept tail of standard output after truncation
STDERR_TAIL = b"e"  # the kept tail of standard error after truncation
EXIT = b"X"        # JSON exit status; the last frame of an exec


def frame(kind: bytes, payload: bytes) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def json_frame(kind: bytes, obj: object) -> bytes:
    return frame(kind, json.dumps(obj).encode())
