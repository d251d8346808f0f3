"""Small pieces without a sandbox: output capping, wire framing, Connect envelopes, multipart, templates."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import pytest

from services.sandbox import envd_api, templates, wire
from services.sandbox.init import Stream
from services.sandbox.templates import TemplateError, TemplateStore


def test_stream_keeps_head_and_tail():
    s = Stream(-1, wire.STDOUT, wire.STDOUT_TAIL, cap=10)
    forwarded = s.feed(b"abc") + s.feed(b"defghij") + s.feed(b"klmnopqrstuvwxyz")
    assert forwarded == b"abcde" and s.truncated and bytes(s.tail) == b"vwxyz"
    small = Stream(-1, wire.STDOUT, wire.STDOUT_TAIL, cap=10)
    assert small.feed(b"12345") == b"12345" and not small.truncated


def test_wire_and_connect_envelopes():
    f = wire.json_frame(wire.EXIT, {"exit_code": 3})
    kind, length = wire.HEADER.unpack(f[:5])
    assert kind == wire.EXIT and json.loads(f[5:5 + length]) == {"exit_code": 3}
    env = envd_api.envelope({"process": {"cmd": "ls"}})
    assert env[0] == 0 and envd_api.parse_envelope(env) == {"process": {"cmd": "ls"}}
    assert envd_api.envelope({}, flags=2)[0] == 2


def test_multipart_parser():
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/a.bin\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n\x00\r\n\x01binary\r\n--XyZ--\r\n")
    assert envd_api.parse_multipart(body, "multipart/form-data; boundary=XyZ") == [("/home/user/a.bin",
                                                                                      b"\x00\r\n\x01binary")]


def test_template_missing_says_how_to_build(tmp_path):
    store = TemplateStore(tmp_path)
    with pytest.raises(TemplateError) as e:
        store.get("default")
    assert "python -m services.sandbox template build default" in str(e.value)
    with pytest.raises(TemplateError):
        store.get("../evil")


def test_build_without_debootstrap_explains(tmp_path, monkeypatch):
    monkeypatch.setattr(templates.shutil, "which", lambda name: None)
    monkeypatch.setattr(templates.os.path, "exists", lambda p: False)
    with pytest.raises(TemplateError) as e:
        TemplateStore(tmp_path).build("default")
    assert "apt-get install -y debootstrap" in str(e.value)


def test_build_is_a_no_op_when_present(tmp_path, monkeypatch):
    store = TemplateStore(tmp_path)
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "sh").write_text("#!fake\n")
    store.import_path("default", src)
    monkeypatch.setattr(templates.subprocess, "run", lambda *a, **k: pytest.fail("debootstrap must not run"))
    assert store.build("default").source == "directory"


def test_import_directory_and_tarball(tmp_path):
    store = TemplateStore(tmp_path / "home")
    src = tmp_path / "rootfs"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "sh").write_text("#!fake\n")
    (src / "etc").mkdir()
    (src / "etc" / "os-release").write_text("ID=tiny\n")
    t = store.import_path("tiny", src)
    assert t.source == "directory" and (t.rootfs / "etc" / "os-release").read_text() == "ID=tiny\n"
    assert (t.rootfs / "proc").is_dir() and (t.rootfs / "tmp").is_dir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(src, arcname=".")
    archive = tmp_path / "rootfs.tar.gz"
    archive.write_bytes(buf.getvalue())
    t2 = store.import_path("tiny-tar", archive)
    assert t2.source == "tar" and (t2.rootfs / "bin" / "sh").exists()
    assert [x.name for x in store.list()] == ["tiny", "tiny-tar"]
    with pytest.raises(TemplateError):
        store.import_path("tiny", src)  # exists
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TemplateError) as e:
        store.import_path("bad", empty)
    assert "/bin/sh" in str(e.value)
    store.remove("tiny")
    assert [x.name for x in store.list()] == ["tiny-tar"]


def test_cli_template_list_and_help(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.sandbox", "--home", str(tmp_path), "template", "list"],
                         capture_output=True, text=True, check=True)
    assert out.stdout == ""
    out = subprocess.run([sys.executable, "-m", "services.sandbox", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--grpc-port" in out.stdout and "--backend" in out.stdout


async def test_one_service_per_state_directory(tmp_path):
    from services.sandbox.config import SandboxConfig
    from services.sandbox.manager import Manager

    first = Manager(SandboxConfig(home=tmp_path, backend="process", pool_size=0))
    await first.start()
    try:
        second = Manager(SandboxConfig(home=tmp_path, backend="process", pool_size=0))
        with pytest.raises(RuntimeError) as e:
            await second.start()
        assert "--home" in str(e.value)
    finally:
        await first.stop(kill_all=True)
    third = Manager(SandboxConfig(home=tmp_path, backend="process", pool_size=0))
    await third.start()
    await third.stop(kill_all=True)


async def test_exec_guard_when_init_hangs(tmp_path):
    """A stuck init (here: a socket that never answers) ends in DEADLINE_EXCEEDED, not a hang."""
    import asyncio

    from services.sandbox import channel
    from services.sandbox.errors import SandboxError

    async def silent(reader, writer):
        await asyncio.sleep(5)

    path = str(tmp_path / "s.sock")
    server = await asyncio.start_unix_server(silent, path=path)
    try:
        with pytest.raises(SandboxError) as e:
            async for _ in channel.exec_stream(path, {"argv": ["true"]}, guard_s=0.3):
                pass
        assert e.value.code == "deadline_exceeded"
    finally:
        server.close()
