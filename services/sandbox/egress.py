"""Policy-checked egress: an HTTP(S) proxy per sandbox on a Unix socket, enforced and logged by the service.

A sandbox has no network but loopback. With egress allowed, its directory
`<sockets>/<id>.egress/` (holding `egress.sock`) is bind-mounted at
`/run/rlyard` inside, and a relay in the sandbox forwards 127.0.0.1:3128 to
that socket; commands get HTTP(S)_PROXY pointing there. The proxy accepts
`CONNECT host:port` (HTTPS and any TCP) and absolute-URI HTTP requests, and
lets a destination through only if its domain is allowed ("example.com"
also allows subdomains) or all its addresses fall in an allowed CIDR block.
Loopback, private and link-local addresses are refused unless a CIDR names
them, so an allowed name cannot be pointed at the host's own services.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SANDBOX_PORT = 3128
SANDBOX_DIR = "/run/rlyard"
MAX_HEADER = 16384


@dataclass
class Policy:
    allow_domains: list[str] = field(default_factory=list)
    allow_cidrs: list[str] = field(default_factory=list)
    allow_public: bool = False  # any public address (E2B's allow_internet_access); never internal ones

    def __post_init__(self) -> None:
        self.domains = [d.strip().lower().rstrip(".").lstrip("*.") for d in self.allow_domains if d.strip()]
        try:
            self.networks = [ipaddress.ip_network(c.strip(), strict=False) for c in self.allow_cidrs if c.strip()]
        except ValueError as e:
            raise ValueError(f"bad CIDR in the network policy: {e}") from e

    def domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.domains)

    def address_allowed(self, addr: str, by_domain: bool) -> bool:
        ip = ipaddress.ip_address(addr)
        if any(ip in net for net in self.networks):
            return True
        internal = ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_unspecified
        return (by_domain or self.allow_public) and not internal


def proxy_env() -> dict[str, str]:
    url = f"http://127.0.0.1:{SANDBOX_PORT}"
    return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
            "NO_PROXY": "localhost,127.0.0.1", "no_proxy": "localhost,127.0.0.1"}


async def _resolve(host: str, port: int) -> list[str]:
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class EgressProxy:
    """One Unix-socket proxy server per sandbox with egress."""

    def __init__(self) -> None:
        self.servers: dict[str, asyncio.AbstractServer] = {}

    async def start(self, sid: str, directory: Path, policy: Policy) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "egress.sock"
        if path.exists():
            path.unlink()
        server = await asyncio.start_unix_server(lambda r, w: self._handle(sid, policy, r, w), path=str(path))
        os.chmod(path, 0o666)
        self.servers[sid] = server

    async def stop(self, sid: str) -> None:
        server = self.servers.pop(sid, None)
        if server is not None:
            server.close()

    async def _handle(self, sid: str, policy: Policy, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            writer.close()
            return
        try:
            method, target, version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        except ValueError:
            await self._refuse(writer, 400, "malformed request line")
            return
        if method.upper() == "CONNECT":
            host, _, port_s = target.rpartition(":")
            host = host.strip("[]")
            rest = b""
        elif target.startswith("http://"):
            hostport, _, path = target[7:].partition("/")
            host, _, port_s = hostport.partition(":")
            port_s = port_s or "80"
            # Forward the request in origin form.
            rest = head.replace(target.encode("latin-1"), b"/" + path.encode("latin-1"), 1)
        else:
            await self._refuse(writer, 400, "use CONNECT host:port or an absolute http:// URL")
            return
        try:
            port = int(port_s)
        except ValueError:
            await self._refuse(writer, 400, f"bad port {port_s!r}")
            return
        by_domain = policy.domain_allowed(host)
        try:
            ipaddress.ip_address(host)
            literal = True
        except ValueError:
            literal = False
        if not by_domain and not policy.networks and not policy.allow_public and not literal:
            log.info("egress %s: %s:%d DENIED by policy (domain not allowed)", sid, host, port)
            await self._refuse(writer, 403, f"{host}:{port} is not allowed by this sandbox's network policy")
            return
        try:
            addrs = await _resolve(host, port)
        except OSError as e:
            log.info("egress %s: %s:%d refused (cannot resolve: %s)", sid, host, port, e)
            await self._refuse(writer, 502, f"cannot resolve {host}")
            return
        allowed = [a for a in addrs if policy.address_allowed(a, by_domain)]
        if not addrs or len(allowed) != len(addrs):
            log.info("egress %s: %s:%d DENIED by policy (%s)", sid, host, port, ",".join(addrs))
            await self._refuse(writer, 403, f"{host}:{port} is not allowed by this sandbox's network policy")
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(allowed[0], port), 15)
        except (OSError, asyncio.TimeoutError) as e:
            log.info("egress %s: %s:%d allowed, connect failed: %s", sid, host, port, e)
            await self._refuse(writer, 502, f"cannot connect to {host}:{port}")
            return
        log.info("egress %s: %s:%d allowed (%s)", sid, host, port, allowed[0])
        if rest:
            up_w.write(rest)
        else:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer), return_exceptions=True)

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, code: int, reason: str) -> None:
        body = (reason + "\n").encode()
        writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        try:
            await writer.drain()
        finally:
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
