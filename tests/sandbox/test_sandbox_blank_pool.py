"""Blank sandboxes (started up to their root filesystem): the sandboxes made from them are indistinguishable
from sandboxes started in one go, failures leave nothing behind, and forks and cold creates use them."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from services.sandbox.config import SandboxConfig
from services.sandbox.errors import SandboxError
from services.sandbox.manager import Manager
from services.sandbox.templates import default_home
from tests.sandbox.conftest import need_namespace_backend

# What a command can observe of its isolation: identity, namespaces' view, limits, privileges, mounts.
PROBE = r"""
hostname; id -u; cat /proc/1/comm; ls /dev | tr '\n' ' '; echo
grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status
cat /proc/self/cgroup | sed 's/^[0-9]*://' | sort
ip -o link 2>/dev/null | awk '{print $2}' || ls /sys/class/net
test -r /proc/kcore && echo kcore-readable; cat /proc/timer_list | wc -c
touch /proc/sys/kernel/hostname 2>/dev/null && echo proc-sys-writable
findmnt -rn -o TARGET,FSTYPE,OPTIONS | grep -v '^/proc/' | sort
cat /proc/self/oom_score_adj; ulimit -n; ls /proc/self/fd | wc -l
"""


async def _manager(home, blank_pool: int) -> Manager:
    home.mkdir(parents=True, exist_ok=True)
    (home / "templates").symlink_to(default_home() / "templates")
    m = Manager(SandboxConfig(home=home, pool_size=0, blank_pool=blank_pool, max_sandboxes=20))
    await m.start()
    return m


async def _filled(m: Manager, n: int) -> None:
    for _ in range(600):
        if len(m.blanks.boxes) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the blank pool did not reach {n}")


@pytest.fixture
async def managers(tmp_path):
    need_namespace_backend()
    with_blanks = await _manager(tmp_path / "blanks", 3)
    without = await _manager(tmp_path / "plain", 0)
    yield with_blanks, without
    for m in (with_blanks, without):
        await m.stop(kill_all=True)
    shutil.rmtree(tmp_path, ignore_errors=True)


async def test_blank_sandboxes_are_like_any_other(managers):
    m, plain = managers
    await _filled(m, 3)
    blank_ids = {b.id for b in m.blanks.boxes}
    box = await m.create()
    assert box.id in blank_ids and len(m.blanks.boxes) == 2  # taken from the pool
    ref = await plain.create()
    got, want = await m.run(box.id, shell=PROBE), await plain.run(ref.id, shell=PROBE)
    assert got["exit_code"] == want["exit_code"] == 0, got["stderr"]
    def normal(out: bytes, mgr: Manager, sid: str) -> bytes:
        return out.replace(sid.encode(), b"ID").replace(str(mgr.config.home).encode(), b"HOME")
    assert normal(got["stdout"], m, box.id) == normal(want["stdout"], plain, ref.id)
    assert b"Seccomp:\t2" in got["stdout"] and b"NoNewPrivs:\t1" in got["stdout"]
    r = await m.run(box.id, argv=["/bin/sh", "-c", "echo $$"])  # run() gets the pid with the exit status
    assert r["pid"] > 1 and r["stdout"] == f"{r['pid']}\n".encode()
    # Limits asked for at create apply to a blank too.
    small = await m.create(resources=m._resources(memory_mb=64, pids=32, disk_mb=16))
    assert small.id in blank_ids
    r = await m.run(small.id, shell="cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || true; "
                                    "df -m / | tail -1 | awk '{print $2}'; head -c 20000000 /dev/zero > /root/f")
    assert r["exit_code"] != 0 and b"No space left" in r["stderr"]
    assert m.cgroups.path("memory", small.id).joinpath("memory.limit_in_bytes").read_text().strip() == str(64 << 20)


async def test_fork_children_come_from_blanks(managers):
    m, _ = managers
    await _filled(m, 3)
    parent = await m.create()  # takes one blank
    await _filled(m, 3)
    blank_ids = {b.id for b in m.blanks.boxes}
    await m.run(parent.id, shell="echo one > /root/state")
    children, _ = await m.fork(parent.id, 2)
    assert {c.id for c in children} <= blank_ids
    await m.run(parent.id, shell="echo two > /root/state")
    for c in children:
        r = await m.run(c.id, shell="cat /root/state; echo child >> /root/state; cat /root/state")
        assert r["stdout"] == b"one\none\nchild\n"
    assert (await m.run(parent.id, argv=["cat", "/root/state"]))["stdout"] == b"two\n"


async def test_failed_attach_leaves_nothing(managers):
    m, _ = managers
    await _filled(m, 1)
    before = set(os.listdir(m.storage.boxes))
    with pytest.raises(SandboxError) as e:
        await m._launch(m.config.default_template, ["/no/such/layer"], 60, False, {}, {}, m._resources(), "")
    assert e.value.code == "internal" and "root filesystem" in e.value.message
    await asyncio.sleep(0.1)
    assert not m.boxes
    left = set(os.listdir(m.storage.boxes)) - before
    assert all(sid in {b.id for b in m.blanks.boxes} for sid in left)  # only refilled blanks, nothing leaked
    assert m.cgroups.list_ids() <= {b.id for b in m.blanks.boxes}


async def test_sandbox_from_a_blank_is_readopted_after_restart(tmp_path):
    need_namespace_backend()
    m = await _manager(tmp_path / "home", 2)
    await _filled(m, 2)
    box = await m.create()
    assert box.id not in {b.id for b in m.blanks.boxes}
    await m.run(box.id, shell="echo kept > /root/f")
    await asyncio.sleep(0)  # the deferred state write
    await m.stop(kill_all=False)  # upgrade-style: sandboxes stay, the unused blanks go
    again = Manager(SandboxConfig(home=tmp_path / "home", pool_size=0, blank_pool=0))
    await again.start()
    try:
        assert set(again.boxes) == {box.id}
        assert (await again.run(box.id, argv=["cat", "/root/f"]))["stdout"] == b"kept\n"
    finally:
        await again.stop(kill_all=True)
    assert list((tmp_path / "home" / "sandbox" / "boxes").iterdir()) == []
