"""The unmodified e2b SDK drives the service's E2B-compatible HTTP API and envd routes."""
from __future__ import annotations

import shutil

import httpx
import pytest

from tests.sandbox.conftest import need_namespace_backend, start_service

API_KEY = "e2b_" + "5" * 40

e2b = pytest.importorskip("e2b")


@pytest.fixture(scope="module")
def e2b_service(tmp_path_factory):
    need_namespace_backend()
    home = tmp_path_factory.mktemp("e2bhome")
    svc = start_service(home, "--on-exit", "kill", "--api-key", API_KEY)
    yield svc
    svc.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def sdk_env(e2b_service, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", e2b_service.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_service.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return e2b_service


def test_sdk_session(sdk_env):
    from e2b import Sandbox
    from e2b import CommandExitException, TimeoutException

    sb = Sandbox.create(timeout=120, metadata={"suite": "e2b"}, envs={"GREETING": "hi"})
    try:
        r = sb.commands.run("echo -n nano_miles_rl | sha256sum; python3 -c 'print(6*7)'; echo $GREETING")
        assert r.exit_code == 0
        assert r.stdout.splitlines() == [
            "040ef1c12b686434e246bd59f9a35e72916243c6e72c8294a0089fea08bf7e2b  -", "42", "hi"]
        seen = []
        sb.commands.run("echo a; echo b >&2", on_stdout=seen.append, on_stderr=seen.append)
        assert sorted(x.strip() for x in seen) == ["a", "b"]
        with pytest.raises(CommandExitException) as e:
            sb.commands.run("exit 3")
        assert e.value.exit_code == 3
        with pytest.raises(TimeoutException):
            sb.commands.run("sleep 30", timeout=1)

        info = sb.files.write("/home/user/data/hello.txt", "hello from e2b")
        assert info.path == "/home/user/data/hello.txt"
        assert sb.files.read("/home/user/data/hello.txt") == "hello from e2b"
        assert sb.commands.run("cat /home/user/data/hello.txt").stdout == "hello from e2b"
        assert [e.name for e in sb.files.list("/home/user/data")] == ["hello.txt"]
        assert sb.files.exists("/home/user/data/hello.txt") and not sb.files.exists("/home/user/nope")
        assert sb.files.make_dir("/home/user/newdir") is True
        assert sb.files.make_dir("/home/user/newdir") is False
        sb.files.remove("/home/user/newdir")
        assert not sb.files.exists("/home/user/newdir")

        handle = sb.commands.run("tr a-z A-Z", background=True, stdin=True)
        sb.commands.send_stdin(handle.pid, "hello ")
        sb.commands.send_stdin(handle.pid, "stdin\n")
        sb.commands.close_stdin(handle.pid)
        assert handle.wait().stdout == "HELLO STDIN\n"

        sb.commands.run("head -c 3000000 /dev/urandom > /root/blob")
        metrics = sb.get_metrics()
        assert metrics and metrics[-1].mem_used > 0 and metrics[-1].disk_used >= 3_000_000
        sb.set_timeout(300)
        ids = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sb.sandbox_id in ids

        sb.commands.run("echo state > /root/kept.txt")
        assert sb.pause() is True
        states = {s.sandbox_id: str(s.state) for s in Sandbox.list().next_items()}
        assert states[sb.sandbox_id] == "paused"
        again = Sandbox.connect(sb.sandbox_id, timeout=120)
        assert again.commands.run("cat /root/kept.txt").stdout == "state\n"
        assert again.get_info().state.value == "running"
        assert again.is_running()
    finally:
        sb.kill()
    assert not sb.is_running()
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_api_key_and_access_token_are_checked(sdk_env):
    url = sdk_env.url
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": "wrong"})
    assert r.status_code == 401 and "X-API-Key" in r.json()["message"]
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base", "timeout": 60}, headers={"X-API-Key": API_KEY})
    assert r.status_code == 201
    body = r.json()
    sid, token = body["sandboxID"], body["envdAccessToken"]
    try:
        envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
        r = httpx.get(f"{url}/files", params={"path": "/etc/hostname"}, headers={**envd, "X-Access-Token": "bad"})
        assert r.status_code == 401
        r = httpx.get(f"{url}/files", params={"path": "/etc/hostname"}, headers={**envd, "X-Access-Token": token})
        assert r.status_code == 200 and r.content == b"sandbox\n"
        r = httpx.get(f"{url}/files", params={"path": "/nope"}, headers={**envd, "X-Access-Token": token})
        assert r.status_code == 404
        r = httpx.post(f"{url}/sandboxes/{sid}/pause", headers={"X-API-Key": API_KEY})
        assert r.status_code == 204
        r = httpx.post(f"{url}/sandboxes/{sid}/pause", headers={"X-API-Key": API_KEY})
        assert r.status_code == 409
    finally:
        assert httpx.delete(f"{url}/sandboxes/{sid}", headers={"X-API-Key": API_KEY}).status_code == 204
    assert httpx.delete(f"{url}/sandboxes/{sid}", headers={"X-API-Key": API_KEY}).status_code == 404
    r = httpx.get(f"{url}/health", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_sdk_session_with_another_sdk_version(sdk_env):
    """The same SDK session with e2b 2.48, from the side venv `make install` builds (.venv-e2b248),
    or from the interpreter RLYARD_E2B_LEGACY_PYTHON names."""
    import os
    import subprocess
    from pathlib import Path

    side_venv = Path(__file__).resolve().parents[2] / ".venv-e2b248" / "bin" / "python"
    python = os.environ.get("RLYARD_E2B_LEGACY_PYTHON") or (str(side_venv) if side_venv.exists() else "")
    if not python:
        pytest.skip("no e2b 2.48 interpreter: run `make install` (builds .venv-e2b248) "
                    "or set RLYARD_E2B_LEGACY_PYTHON")
    script = Path(__file__).with_name("e2b_session_script.py")
    out = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert "SESSION-OK" in out.stdout, out.stdout + out.stderr


def test_http_errors_are_clear(sdk_env):
    url, h = sdk_env.url, {"X-API-Key": API_KEY}
    r = httpx.post(f"{url}/v2/sandboxes", content=b"{not json", headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["message"]
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "no-such-template"}, headers=h)
    assert r.status_code == 404 and "template" in r.json()["message"]
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base", "timeout": 10**9}, headers=h)
    assert r.status_code == 400 and "maximum" in r.json()["message"]
    r = httpx.get(f"{url}/sandboxes/nope", headers=h)
    assert r.status_code == 404 and "nope" in r.json()["message"]
    r = httpx.post(f"{url}/sandboxes/nope/pause", headers=h)
    assert r.status_code == 404
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


async def test_async_sdk(sdk_env):
    from e2b import AsyncSandbox

    sb = await AsyncSandbox.create(timeout=60)
    try:
        r = await sb.commands.run("uname -s | tr A-Z a-z")
        assert r.stdout == "linux\n"
        await sb.files.write("/root/n.txt", "1\n2\n3\n")
        assert (await sb.commands.run("wc -l < /root/n.txt")).stdout.strip() == "3"
        handle = await sb.commands.run("sleep 30", background=True)
        await handle.kill()
    finally:
        await sb.kill()


def test_sdk_fork_and_snapshot(sdk_env):
    from e2b import Sandbox

    sb = Sandbox.create(timeout=120)
    try:
        sb.files.write("/root/state.txt", "parent")
        children = sb.fork(count=2)
        try:
            assert [c.commands.run("cat /root/state.txt").stdout for c in children] == ["parent", "parent"]
            children[0].files.write("/root/state.txt", "child")
            assert sb.files.read("/root/state.txt") == "parent"
        finally:
            for c in children:
                c.kill()
        snap = sb.create_snapshot()
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        restored = Sandbox.create(snap.snapshot_id)
        try:
            assert restored.commands.run("cat /root/state.txt").stdout == "parent"
        finally:
            restored.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        sb.kill()
