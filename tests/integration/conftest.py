"""One stack of the four real services (separate processes) shared by the integration tests."""
import asyncio
import pathlib
import socket

import pytest

from services.launch.stack import Stack, plan
from services.sandbox.templates import default_home


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    sb_grpc, sb_http, engine, trainer, ro_grpc, ro_http = _free_ports(6)
    tmp = tmp_path_factory.mktemp("stack")
    # The sandbox service locks its state folder: this stack gets its own, sharing the built templates.
    sandbox_home = tmp / "sandbox-home"
    sandbox_home.mkdir()
    (sandbox_home / "templates").symlink_to(default_home() / "templates")
    services = {
        "model": "SmolLM2-135M-Instruct",
        "sandbox": {"grpc_port": sb_grpc, "http_port": sb_http, "args": ["--home", str(sandbox_home)]},
        "engine": {"port": engine, "device": "cpu", "dtype": "float32"},
        "trainer": {"port": trainer, "device": "cpu", "checkpoint_dir": str(tmp / "ckpt")},
        "rollout": {"grpc_port": ro_grpc, "http_port": ro_http, "args": ["--runs-dir", str(tmp / "runs")]},
    }
    specs, endpoints = plan(services)
    st = Stack(specs, pathlib.Path(tmp / "logs"))
    try:
        asyncio.run(st.start(timeout=420))
    except BaseException:
        st.stop()
        raise
    yield st, endpoints
    st.stop()
