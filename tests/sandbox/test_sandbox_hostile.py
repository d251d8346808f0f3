"""Hostile input: each attack stays inside its sandbox, and the service keeps answering afterwards."""
from __future__ import annotations

import glob
import os
import socket
import uuid

import grpc
import pytest

from services.common.proto.rlyard.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import SECRET, sh


@pytest.fixture
async def small(stub):
    """A sandbox with tight limits: 96 MiB memory, 64 pids, 32 MiB disk."""
    info = await stub.Create(pb.CreateSandboxRequest(resources=pb.Resources(memory_mb=96, pids=64, disk_mb=32)))
    yield info.sandbox_id
    await stub.Kill(pb.SandboxRef(sandbox_id=info.sandbox_id))


async def assert_service_ok(stub, *sids: str) -> None:
    await stub.List(pb.ListSandboxesRequest())
    for sid in sids:
        r = await sh(stub, sid, "echo alive")
        assert r.stdout == b"alive\n"


async def test_service_secrets_do_not_leak(stub, box, service):
    r = await sh(stub, box, "env; for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done; "
                            "grep -r hf_rlyard /root /etc /tmp 2>/dev/null; ls " + str(service.home))
    assert SECRET.encode() not in r.stdout + r.stderr
    assert b"No such file" in r.stderr  # the service's state directory does not exist in here


async def test_host_files_are_unreachable(stub, box, tmp_path):
    marker = tmp_path / f"host-marker-{uuid.uuid4().hex}"
    marker.write_text(SECRET)
    r = await sh(stub, box, f"cat {marker}; ls /proc/1/root{tmp_path} ; ls /home; cat /proc/1/root{marker}")
    assert SECRET.encode() not in r.stdout and r.exit_code != 0
    await sh(stub, box, f"ln -s {marker} /root/link-out; ln -s / /root/rootlink")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReadFile(pb.ReadFileRequest(sandbox_id=box, path="/root/link-out"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND  # the symlink resolves inside the sandbox
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.ReadFile(pb.ReadFileRequest(sandbox_id=box, path=f"/root/rootlink{marker}"))
    # No capability to mount, pivot or load modules: no way back to the host's tree.
    r = await sh(stub, box, "mount -t tmpfs x /mnt; mount -t proc proc /mnt; unshare -m true; "
                            "grep CapEff /proc/self/status")
    assert r.stderr.count(b"ermission denied") + r.stderr.count(b"Operation not permitted") >= 2
    cap_eff = int(r.stdout.split()[-1], 16)
    assert not cap_eff & (1 << 21) and not cap_eff & (1 << 19)  # no CAP_SYS_ADMIN, no CAP_SYS_PTRACE
    # No raw access to host disks through a device node made inside.
    disk = os.stat("/").st_dev
    r = await sh(stub, box, f"mknod /root/disk b {os.major(disk)} {os.minor(disk)} && head -c 512 /root/disk | wc -c; "
                            "cp -a /dev/null /root/null2 2>&1; echo x > /root/null2 2>&1 || echo blocked")
    assert b"Operation not permitted" in r.stderr + r.stdout and b"512" not in r.stdout
    # A seccomp filter keeps user namespaces (full capabilities over a new namespace) and keyrings away.
    r = await sh(stub, box, "unshare -Ur id; grep -E '^Seccomp:' /proc/self/status; "
                            "python3 -c 'import ctypes; print(ctypes.CDLL(None).syscall(250, 0, 0))'")
    assert b"Operation not permitted" in r.stderr and b"Seccomp:\t2" in r.stdout and r.stdout.endswith(b"-1\n")


async def test_host_ports_are_unreachable(stub, box, service):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = ("import socket,sys\nfor p in (%d, %d, %d):\n  s=socket.socket()\n  s.settimeout(2)\n"
                "  try:\n    s.connect(('127.0.0.1', p)); print('CONNECTED', p)\n"
                "  except OSError as e: print('refused', p)\n") % (port, service.grpc_port, service.http_port)
        r = await stub.Exec(pb.ExecRequest(sandbox_id=box, argv=["python3", "-c", code]))
    assert b"CONNECTED" not in r.stdout and r.stdout.count(b"refused") == 3
    r = await sh(stub, box, "ls /sys/class/net 2>/dev/null || ip -o link | cut -d: -f2")
    assert r.stdout.split() == [b"lo"]
    r = await sh(stub, box, "getent hosts example.com || echo no-dns")
    assert b"no-dns" in r.stdout


async def test_fork_bomb_is_contained(stub, small, box):
    # The bomb forks until the pids limit bites; the busy loop (a builtin, no fork) keeps the command alive
    # until its timeout, which must then kill the whole tree, bomb included.
    r = await sh(stub, small, ":(){ :|:& };:; while :; do :; done", timeout_s=3)
    assert r.timed_out and b"Resource temporarily unavailable" in r.stderr
    await assert_service_ok(stub, box)
    r = await sh(stub, small, "ps -e --no-headers | wc -l")
    assert int(r.stdout) < 10


async def test_memory_bomb_is_contained(stub, small, box):
    r = await stub.Exec(pb.ExecRequest(sandbox_id=small, argv=["python3", "-c",
                                       "b=[bytearray(16<<20) for _ in range(64)]; print('survived')"]))
    assert r.exit_code == 128 + 9 and b"survived" not in r.stdout  # the OOM killer, inside the cgroup
    r = await sh(stub, small, "cat /proc/1/oom_score_adj /proc/self/oom_score_adj")
    init_score, command_score = map(int, r.stdout.split())
    assert init_score <= 0 < command_score  # the killer picks commands before the init
    await assert_service_ok(stub, small, box)


async def test_disk_fill_is_contained(stub, small, box):
    r = await sh(stub, small, "dd if=/dev/zero of=/root/fill bs=1M count=100")
    assert r.exit_code != 0 and b"No space left" in r.stderr
    r = await sh(stub, small, "rm /root/fill && echo freed")
    assert r.stdout == b"freed\n"
    await assert_service_ok(stub, small, box)


async def test_output_flood_is_capped(stub, box, service):
    r = await sh(stub, box, "head -c 300000000 /dev/zero | tr '\\0' x; yes | head -c 50000000 >&2",
                 max_output_bytes=65536)
    assert r.stdout_truncated and r.stderr_truncated
    assert len(r.stdout) == 65536 and len(r.stderr) == 65536
    rss_kb = int(next(line for line in open(f"/proc/{service.proc.pid}/status")
                      if line.startswith("VmRSS")).split()[1])
    assert rss_kb < 400 * 1024
    await assert_service_ok(stub, box)


async def test_orphans_die_with_a_timed_out_command(stub, box):
    r = await sh(stub, box, "(setsid nohup sleep 4001 >/dev/null 2>&1 &); (sleep 4002 & disown); "
                            "bash -c 'sleep 4003 &'; sleep 4004", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 124
    r = await sh(stub, box, "pgrep -x sleep || echo none")
    assert r.stdout == b"none\n"


async def test_kill_everything_from_inside(stub, box):
    await sh(stub, box, "nohup sleep 600 >/dev/null 2>&1 & nohup sleep 601 >/dev/null 2>&1 &")
    r = await stub.Exec(pb.ExecRequest(sandbox_id=box, argv=["python3", "-c", "import os; os.kill(-1, 9)"]))
    assert r.exit_code == 0  # kill(-1) spares the caller and the sandbox's init, nothing outside is reachable
    r = await sh(stub, box, "pgrep -c -x sleep || true; echo ok")
    assert r.stdout == b"0\nok\n"
    await assert_service_ok(stub, box)


async def test_sandboxes_do_not_see_each_other(stub, box):
    other = (await stub.Create(pb.CreateSandboxRequest())).sandbox_id
    try:
        await sh(stub, box, "echo mine > /root/private; nohup sleep 7777 >/dev/null 2>&1 & "
                            "nohup python3 -m http.server 8765 >/dev/null 2>&1 & sleep 0.5")
        r = await sh(stub, other, "cat /root/private; pgrep -x sleep || echo no-proc; "
                                  "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8765), 2)\" "
                                  "2>/dev/null && echo CONNECTED || echo no-conn")
        assert r.stdout == b"no-proc\nno-conn\n"
        r = await sh(stub, box, "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8765), 2)\" "
                                "&& echo CONNECTED")
        assert r.stdout == b"CONNECTED\n"  # the server is real; only the other sandbox cannot reach it
        r = await sh(stub, other, "ps -e --no-headers | wc -l")
        assert int(r.stdout) <= 4  # init, bash, ps, wc: no host or neighbour processes
    finally:
        await stub.Kill(pb.SandboxRef(sandbox_id=other))


async def test_control_socket_is_not_reachable(stub, box, service):
    socks = [p for p in glob.glob(f"/run/rlyard-*/{box}.sock") + glob.glob(f"/tmp/rlyard-*/{box}.sock")]
    assert len(socks) == 1
    r = await sh(stub, box, f"ls {socks[0]}; find / -xdev -name '*.sock' 2>/dev/null")
    assert b".sock" not in r.stdout
