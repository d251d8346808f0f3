"""gRPC server plumbing: an asyncio server with health checking and reflection.

Every rlyard service builds its server here so that `grpc.health.v1.Health`
and server reflection are always present, and shutdown is graceful.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class ServiceServer:
    """An asyncio gRPC server hosting one or more servicers plus health and reflection."""

    def __init__(self, host: str, port: int) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self.address = f"{host}:{port}"
        self.port = port

    def add(self, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str) -> None:
        """Register `servicer` (e.g. `add_SandboxServicer_to_server`) under its full service name."""
        add_fn(servicer, self.server)
        self._names.append(full_name)

    async def start(self) -> int:
        """Bind, start serving and mark every service SERVING; return the bound port."""
        reflection.enable_server_reflection([*self._names, reflection.SERVICE_NAME], self.server)
        bound = self.server.add_insecure_port(self.address)
        if bound == 0:
            raise RuntimeError(f"cannot bind gRPC port {self.address}")
        self.port = bound
        await self.server.start()
        for name in ["", *self._names]:
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        log.info("gRPC serving on port %d: %s", bound, ", ".join(self._names[1:]))
        return bound

    async def stop(self, grace: float = 5.0) -> None:
        """Mark NOT_SERVING and stop, letting in-flight calls finish within `grace` seconds."""
        for name in ["", *self._names]:
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
        await self.server.stop(grace)


async def _maybe_await(value: Any) -> None:
    if asyncio.iscoroutine(value):
        await value


def stop_event_on_signals(sigs: Iterable[int] = (signal.SIGINT, signal.SIGTERM)) -> asyncio.Event:
    """Return an event set when the process receives SIGINT or SIGTERM."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in sigs:
        loop.add_signal_handler(sig, event.set)
    return event


def channel(target: str) -> grpc.aio.Channel:
    """An asyncio client channel with rlyard's message-size limits."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


async def check_health(target: str, service: str = "", timeout: float = 2.0) -> bool:
    """True when the gRPC server at `target` reports SERVING for `service`."""
    async with channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
