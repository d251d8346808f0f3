"""Inside a sandbox with egress: forward TCP 127.0.0.1:3128 to the service's proxy socket.

Runs as its own small process (forked by the sandbox's init), so a busy
transfer never delays the init. Standard library only.
"""
from __future__ import annotations

import os
import select
import socket

BUF = 65536
MAX_PENDING = 1 << 20


class _Pair:
    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.socks = (a, b)
        self.out = {a: bytearray(), b: bytearray()}  # bytes waiting to be written to that socket
        self.closed: set[socket.socket] = set()

    def other(self, s: socket.socket) -> socket.socket:
        return self.socks[1] if s is self.socks[0] else self.socks[0]


def relay(listener: socket.socket, target: str) -> None:
    """Serve forever: each accepted connection is paired with a new connection to `target`."""
    listener.setblocking(False)
    pairs: dict[socket.socket, _Pair] = {}
    while True:
        rlist: list = [listener]
        wlist: list = []
        for s, p in pairs.items():
            if s not in p.closed and len(p.out[p.other(s)]) < MAX_PENDING:
                rlist.append(s)
            if p.out[s]:
                wlist.append(s)
        readable, writable, _ = select.select(rlist, wlist, [])
        if listener in readable:
            try:
                client, _ = listener.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.connect(target)
            except OSError:
                try:
                    client.close()
                except (OSError, UnboundLocalError):
                    pass
            else:
                client.setblocking(False)
                upstream.setblocking(False)
                pair = _Pair(client, upstream)
                pairs[client] = pairs[upstream] = pair
        for s in readable:
            if s is listener or s not in pairs:
                continue
            p = pairs[s]
            try:
                data = s.recv(BUF)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                p.out[p.other(s)] += data
            else:
                p.closed.add(s)
                if not p.out[p.other(s)]:
                    _shutdown(p.other(s))
        for s in writable:
            if s not in pairs:
                continue
            p = pairs[s]
            try:
                n = s.send(p.out[s])
                del p.out[s][:n]
            except BlockingIOError:
                pass
            except OSError:
                p.closed.update(p.socks)
                p.out[s].clear()
            if not p.out[s] and p.other(s) in p.closed:
                _shutdown(s)
        for s in list(pairs):
            p = pairs.get(s)
            if p and len(p.closed) == 2 and not any(p.out.values()):
                for x in p.socks:
                    pairs.pop(x, None)
                    x.close()


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def start(port: int, target: str) -> int:
    """Fork the relay process; returns its pid. Call inside the sandbox's network namespace."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    pid = os.fork()
    if pid == 0:
        try:
            keep = listener.fileno()
            os.closerange(3, keep)  # the init's control socket and set-up pipe are not the relay's business
            os.closerange(keep + 1, 65536)
            from services.sandbox.linux import set_process_name
            set_process_name("rlyard-egress")
            relay(listener, target)
        finally:
            os._exit(0)
    listener.close()
    return pid
