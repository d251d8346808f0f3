"""The one exception the sandbox service raises for a request it cannot serve, with its status class."""
from __future__ import annotations

import grpc

# code -> (gRPC status, HTTP status)
CODES: dict[str, tuple[grpc.StatusCode, int]] = {
    "not_found": (grpc.StatusCode.NOT_FOUND, 404),
    "failed_precondition": (grpc.StatusCode.FAILED_PRECONDITION, 409),
    "resource_exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    "invalid_argument": (grpc.StatusCode.INVALID_ARGUMENT, 400),
    "already_exists": (grpc.StatusCode.ALREADY_EXISTS, 409),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, 503),
    "deadline_exceeded": (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    "internal": (grpc.StatusCode.INTERNAL, 500),
}


class SandboxError(Exception):
    """A request failed; `code` is a key of CODES and the message tells the user what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code if code in CODES else "internal"
        self.message = message

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return CODES[self.code][0]

    @property
    def http_status(self) -> int:
        return CODES[self.code][1]


def not_found(sandbox_id: str) -> SandboxError:
    return SandboxError("not_found", f"sandbox {sandbox_id!r} was not found (killed, expired, or never created); "
                                     "list live sandboxes with List")
