"""Egress: none by default; with a policy, only allowed destinations pass through the service's proxy."""
from __future__ import annotations

import http.server
import threading

import grpc
import pytest

from services.common.proto.rlyard.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import sh


@pytest.fixture(scope="module")
def web():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"hello-egress"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


async def _box(stub, **network):
    info = await stub.Create(pb.CreateSandboxRequest(network=pb.NetworkPolicy(**network)))
    return info.sandbox_id


CURL = "curl -s -S --max-time 5 --noproxy '' -x http://127.0.0.1:3128"


async def test_allowed_cidr_passes_plain_and_connect(stub, web):
    sid = await _box(stub, allow_egress=True, allow_cidrs=["127.0.0.1/32"])
    try:
        r = await sh(stub, sid, f"{CURL} http://127.0.0.1:{web}/; echo; {CURL} -p http://127.0.0.1:{web}/")
        assert r.stdout == b"hello-egress\nhello-egress", r.stderr
        r = await sh(stub, sid, "echo $HTTPS_PROXY; ip -o link | cut -d: -f2")
        assert r.stdout.split() == [b"http://127.0.0.1:3128", b"lo"]
    finally:
        await stub.Kill(pb.SandboxRef(sandbox_id=sid))


async def test_policy_denies_everything_else(stub, web):
    sid = await _box(stub, allow_egress=True, allow_domains=["example.test"])
    try:
        r = await sh(stub, sid, f"{CURL} -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{web}/; echo; "
                                f"{CURL} -o /dev/null -w '%{{http_code}}' http://localhost:{web}/; echo; "
                                f"{CURL} -p https://elsewhere.test/ 2>&1")
        lines = r.stdout.decode().splitlines()
        assert lines[:2] == ["403", "403"] and "CONNECT tunnel failed, response 403" in lines[2], r.stdout
    finally:
        await stub.Kill(pb.SandboxRef(sandbox_id=sid))


async def test_no_egress_by_default(stub, box, web):
    r = await sh(stub, box, f"{CURL} http://127.0.0.1:{web}/ ; ls /run/rlyard")
    assert r.exit_code != 0 and b"hello-egress" not in r.stdout


async def test_bad_policy_is_rejected(stub):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        bad = pb.NetworkPolicy(allow_egress=True, allow_cidrs=["10.0.0.0/33"])
        await stub.Create(pb.CreateSandboxRequest(network=bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Create(pb.CreateSandboxRequest(network=pb.NetworkPolicy(allow_domains=["x.org"])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
