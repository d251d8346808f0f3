"""The userns and process backends through the in-process Manager (the namespace backend is covered by
the service tests), plus backend selection."""
from __future__ import annotations

import logging
import os

import pytest

from services.sandbox import backends
from services.sandbox.config import SandboxConfig
from services.sandbox.errors import SandboxError
from services.sandbox.manager import Manager
from services.sandbox.templates import TemplateStore, default_home


async def make_manager(tmp_path, backend: str) -> Manager:
    (tmp_path / "templates").symlink_to(default_home() / "templates")
    m = Manager(SandboxConfig(home=tmp_path, backend=backend, pool_size=0))
    await m.start()
    return m


@pytest.mark.parametrize("backend", ["userns", "process"])
async def test_backend_runs_commands_and_contains_them(tmp_path, backend, monkeypatch):
    if backend == "userns" and (backends.probe()["userns"] or not TemplateStore().exists("default")):
        pytest.skip(f"userns backend not usable here: {backends.probe()['userns'] or 'no default template'}")
    monkeypatch.setenv("HF_TOKEN", "hf_backend_secret")
    m = await make_manager(tmp_path, backend)
    try:
        box = await m.create()
        assert box.backend == backend
        r = await m.run(box.id, shell="echo -n nano_miles_rl | sha256sum; python3 -c 'print(6*7)'; env")
        assert r["exit_code"] == 0 and b"42\n" in r["stdout"]
        assert b"040ef1c12b686434e246bd59f9a35e72916243c6e72c8294a0089fea08bf7e2b" in r["stdout"]
        assert b"hf_backend_secret" not in r["stdout"]
        # Durations unlikely to be used by anything else on the host (the process backend sees it all).
        r = await m.run(box.id, shell="sleep 1231 & setsid sleep 1232 & sleep 1233", timeout_s=0.5)
        assert r["timed_out"] and r["exit_code"] == 124
        r = await m.run(box.id, shell="ps -eo args | grep -c '^sleep 123[123]$' || true")
        assert r["stdout"].strip() == b"0"
        reply, _ = await m.file_op(box.id, "write", b"data", path="sub/f.txt")
        _, data = await m.file_op(box.id, "read", path="sub/f.txt")
        assert data == b"data"
        with pytest.raises(SandboxError) as e:
            await m.file_op(box.id, "read", path="../../etc/passwd")
        assert e.value.code == "invalid_argument"
        if backend == "process":
            await m.run(box.id, shell="ln -s /etc/passwd link")
            with pytest.raises(SandboxError) as e:
                await m.file_op(box.id, "read", path="link")
            assert e.value.code == "invalid_argument" and "symlink" in e.value.message
        else:
            r = await m.run(box.id, shell="hostname; ls /proc | grep -c '^[0-9]'")
            assert r["stdout"].split()[0] == b"sandbox" and int(r["stdout"].split()[1]) < 6
        await m.kill(box.id)
    finally:
        await m.stop(kill_all=True)


def test_process_backend_warns_loudly(caplog):
    with caplog.at_level(logging.WARNING):
        assert backends.choose("process") == "process"
    assert "ISOLATION IS WEAK" in caplog.text


def test_auto_choice_and_bad_names(caplog):
    with caplog.at_level(logging.INFO):
        chosen = backends.choose("auto")
    assert chosen == ("namespace" if os.geteuid() == 0 else chosen)
    assert f"isolation backend: {chosen} (auto" in caplog.text
    with pytest.raises(ValueError):
        backends.choose("docker")
