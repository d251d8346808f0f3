"""The gRPC Sandbox service end to end: exec semantics, files, lifecycle, snapshot, fork and error codes."""
from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
import time

import grpc
import pytest

from services.common.proto.rlyard.v1 import common_pb2, sandbox_pb2 as pb
from tests.sandbox.conftest import sh


async def test_rl_task_commands(stub, box):
    r = await sh(stub, box, "echo -n nano_miles_rl | sha256sum")
    assert r.exit_code == 0
    assert r.stdout.split()[0].decode() == hashlib.sha256(b"nano_miles_rl").hexdigest()
    assert (await sh(stub, box, "python3 -c 'print(6*7)'")).stdout == b"42\n"
    assert (await sh(stub, box, "uname -s | tr A-Z a-z")).stdout == b"linux\n"
    r = await sh(stub, box, "printf '1\\n2\\n3\\n' > numbers.txt && wc -l < numbers.txt")
    assert r.stdout.strip() == b"3"
    assert (await sh(stub, box, "git --version")).exit_code == 0


async def test_exec_argv_cwd_env_stdin_exit(stub, box):
    r = await stub.Exec(pb.ExecRequest(sandbox_id=box, argv=["/bin/sh", "-c", "pwd; echo $FOO; cat"],
                                       cwd="/tmp", env={"FOO": "bar"}, stdin=b"from stdin"))
    assert r.stdout == b"/tmp\nbar\nfrom stdin"
    r = await sh(stub, box, "echo oops >&2; exit 7")
    assert (r.exit_code, r.stderr) == (7, b"oops\n")
    r = await stub.Exec(pb.ExecRequest(sandbox_id=box, argv=["no-such-program"]))
    assert r.exit_code == 127 and b"no-such-program" in r.stderr
    r = await sh(stub, box, "kill -9 $$")
    assert r.exit_code == 128 + 9
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Exec(pb.ExecRequest(sandbox_id=box, argv=["true"], cwd="/no/such/dir"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "/no/such/dir" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Exec(pb.ExecRequest(sandbox_id=box))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_timeout_kills_whole_tree(stub, box):
    t0 = time.monotonic()
    r = await sh(stub, box, "sleep 300 & setsid sleep 301 & (sleep 302 &) ; sleep 303", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 124
    assert time.monotonic() - t0 < 10
    left = await sh(stub, box, "ps -eo args | grep -c '^sleep 30' || true")
    assert left.stdout.strip() == b"0", left.stdout


async def test_output_cap_keeps_head_and_tail(stub, box):
    r = await sh(stub, box, "echo START; seq 1 200000; echo END", max_output_bytes=1000)
    assert r.stdout_truncated and not r.stderr_truncated
    assert len(r.stdout) == 1000
    assert r.stdout.startswith(b"START\n1\n2\n") and r.stdout.endswith(b"199999\n200000\nEND\n")


async def test_exec_stream_events(stub, box):
    kinds, out = [], b""
    req = pb.ExecRequest(sandbox_id=box, shell="for i in 1 2 3; do echo $i; sleep 0.05; done; exit 4")
    async for ev in stub.ExecStream(req):
        kinds.append(ev.WhichOneof("event"))
        out += ev.stdout
        if ev.HasField("end"):
            assert ev.end.exit_code == 4
    assert kinds[0] == "started_pid" and kinds[-1] == "end" and kinds.count("stdout") >= 2
    assert out == b"1\n2\n3\n"


async def test_environment_is_sanitized(stub, box):
    r = await sh(stub, box, "env; cat /proc/1/environ | tr '\\0' '\\n'")
    assert b"HF_TOKEN" not in r.stdout and b"AWS_SECRET" not in r.stdout and b"PYTHONPATH" not in r.stdout
    assert b"PATH=/usr/local/sbin" in r.stdout


async def test_files_roundtrip_and_errors(stub, box):
    req = pb.WriteFileRequest(sandbox_id=box, path="d/e/f.bin", data=bytes(range(256)), mode=0o600)
    info = await stub.WriteFile(req)
    assert info.path == "/root/d/e/f.bin" and info.size == 256 and info.mode == 0o600
    assert (await stub.ReadFile(pb.ReadFileRequest(sandbox_id=box, path="/root/d/e/f.bin"))).data == bytes(range(256))
    assert (await sh(stub, box, "stat -c %a d/e/f.bin")).stdout == b"600\n"
    names = [e.name for e in (await stub.ListDir(pb.ListDirRequest(sandbox_id=box, path="d/e"))).entries]
    assert names == ["f.bin"]
    await stub.Remove(pb.RemoveRequest(sandbox_id=box, path="d"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReadFile(pb.ReadFileRequest(sandbox_id=box, path="d/e/f.bin"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    for bad in ("../etc/passwd", "/root/../../etc/shadow"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ReadFile(pb.ReadFileRequest(sandbox_id=box, path=bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ".." in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReadFile(pb.ReadFileRequest(sandbox_id=box, path="/root"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_tar_upload_download(stub, box):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"hello tar"
        ti = tarfile.TarInfo("pkg/readme.txt")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    await stub.UploadTar(pb.UploadTarRequest(sandbox_id=box, path="/opt/up", tar=buf.getvalue()))
    assert (await sh(stub, box, "cat /opt/up/pkg/readme.txt")).stdout == b"hello tar"
    got = (await stub.DownloadTar(pb.DownloadTarRequest(sandbox_id=box, path="/opt/up"))).tar
    with tarfile.open(fileobj=io.BytesIO(got)) as tar:
        assert tar.extractfile("up/pkg/readme.txt").read() == b"hello tar"
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        ti = tarfile.TarInfo("../../escape.txt")
        ti.size = 1
        tar.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.UploadTar(pb.UploadTarRequest(sandbox_id=box, path="/opt/up", tar=evil.getvalue()))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_pause_resume_keeps_processes_and_files(stub, box):
    await sh(stub, box, "echo kept > state.txt; nohup sleep 600 >/dev/null 2>&1 &")
    paused = await stub.Pause(pb.SandboxRef(sandbox_id=box))
    assert paused.state == pb.SANDBOX_STATE_PAUSED
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await sh(stub, box, "true")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Resume" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Pause(pb.SandboxRef(sandbox_id=box))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    resumed = await stub.Resume(pb.SandboxRef(sandbox_id=box))
    assert resumed.state == pb.SANDBOX_STATE_RUNNING
    r = await sh(stub, box, "cat state.txt; pgrep -c -x sleep")
    assert r.stdout == b"kept\n1\n"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Resume(pb.SandboxRef(sandbox_id=box))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_snapshot_and_restore(stub, box):
    await sh(stub, box, "echo v1 > /etc/marker; rm /etc/hostname")
    snap = await stub.Snapshot(pb.SnapshotRequest(sandbox_id=box))
    assert snap.kind == "filesystem" and snap.snapshot_id
    await sh(stub, box, "echo v2 > /etc/marker")
    restored = await stub.Create(pb.CreateSandboxRequest(snapshot_id=snap.snapshot_id))
    try:
        r = await sh(stub, restored.sandbox_id, "cat /etc/marker; test -e /etc/hostname && echo present || echo gone")
        assert r.stdout == b"v1\ngone\n"
    finally:
        await stub.Kill(pb.SandboxRef(sandbox_id=restored.sandbox_id))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Create(pb.CreateSandboxRequest(snapshot_id="snap-nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_fork_children_are_copy_on_write(stub, box):
    await sh(stub, box, "mkdir -p /work && echo parent > /work/f")
    fork = await stub.Fork(pb.ForkRequest(sandbox_id=box, count=3))
    assert len(fork.children) == 3 and fork.kind == "filesystem"
    ids = [c.sandbox_id for c in fork.children]
    try:
        assert all(c.parent_id == box for c in fork.children)
        for i, cid in enumerate(ids):
            await sh(stub, cid, f"echo child{i} >> /work/f")
        outs = [(await sh(stub, cid, "cat /work/f")).stdout for cid in ids]
        assert outs == [f"parent\nchild{i}\n".encode() for i in range(3)]
        assert (await sh(stub, box, "cat /work/f")).stdout == b"parent\n"
    finally:
        for cid in ids:
            await stub.Kill(pb.SandboxRef(sandbox_id=cid))
    for bad in (0, 101):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Fork(pb.ForkRequest(sandbox_id=box, count=bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_too_many_sandboxes(stub, box):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Fork(pb.ForkRequest(sandbox_id=box, count=60))  # the test service allows 40
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sandboxes" in e.value.details()


async def test_unknown_ids_and_bad_args(stub):
    for call, req in ((stub.Get, pb.SandboxRef(sandbox_id="nope")), (stub.Kill, pb.SandboxRef(sandbox_id="nope")),
                      (stub.Exec, pb.ExecRequest(sandbox_id="nope", shell="true"))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(req)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Create(pb.CreateSandboxRequest(template="no-such-template"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "template" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Create(pb.CreateSandboxRequest(env={"BAD=NAME": "x"}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_kill_then_state_and_errors(stub):
    info = await stub.Create(pb.CreateSandboxRequest())
    await stub.Kill(pb.SandboxRef(sandbox_id=info.sandbox_id))
    got = await stub.Get(pb.SandboxRef(sandbox_id=info.sandbox_id))
    assert got.state == pb.SANDBOX_STATE_KILLED
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await sh(stub, info.sandbox_id, "true")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "killed" in e.value.details()
    listed = await stub.List(pb.ListSandboxesRequest())
    assert info.sandbox_id not in [s.sandbox_id for s in listed.sandboxes]


async def test_ttl_kill_and_auto_pause(stub):
    a = await stub.Create(pb.CreateSandboxRequest(timeout_s=1))
    b = await stub.Create(pb.CreateSandboxRequest(timeout_s=1, auto_pause=True))
    try:
        await asyncio.sleep(2.5)
        assert (await stub.Get(pb.SandboxRef(sandbox_id=a.sandbox_id))).state == pb.SANDBOX_STATE_KILLED
        assert (await stub.Get(pb.SandboxRef(sandbox_id=b.sandbox_id))).state == pb.SANDBOX_STATE_PAUSED
        longer = await stub.SetTimeout(pb.SetTimeoutRequest(sandbox_id=b.sandbox_id, timeout_s=600))
        assert longer.expires_at > time.time() + 500
    finally:
        await stub.Kill(pb.SandboxRef(sandbox_id=b.sandbox_id))


async def test_list_filters_and_templates(stub, box):
    other = await stub.Create(pb.CreateSandboxRequest(metadata={"test": "2"}))
    try:
        got = await stub.List(pb.ListSandboxesRequest(metadata={"test": "1"}))
        ids = [s.sandbox_id for s in got.sandboxes]
        assert box in ids and other.sandbox_id not in ids
        got = await stub.List(pb.ListSandboxesRequest(states=[pb.SANDBOX_STATE_PAUSED]))
        assert box not in [s.sandbox_id for s in got.sandboxes]
    finally:
        await stub.Kill(pb.SandboxRef(sandbox_id=other.sandbox_id))
    t = await stub.ListTemplates(common_pb2.Empty())
    assert t.default_template == "default" and "default" in [x.name for x in t.templates]
    info = await stub.Get(pb.SandboxRef(sandbox_id=box))
    assert info.backend == "namespace" and info.snapshot_kind == "filesystem"


async def test_many_sandboxes_and_commands_at_once(stub):
    infos = await asyncio.gather(*(stub.Create(pb.CreateSandboxRequest(metadata={"batch": "many"}))
                                   for _ in range(12)))
    ids = [i.sandbox_id for i in infos]
    try:
        assert len(set(ids)) == 12
        results = await asyncio.gather(*(sh(stub, sid, f"sleep 0.3; echo {n}; hostname")
                                         for n, sid in enumerate(ids) for _ in range(2)))
        assert [r.stdout for r in results] == [f"{n}\nsandbox\n".encode() for n in range(12) for _ in range(2)]
    finally:
        await asyncio.gather(*(stub.Kill(pb.SandboxRef(sandbox_id=sid)) for sid in ids))
    left = await stub.List(pb.ListSandboxesRequest(metadata={"batch": "many"}))
    assert not left.sandboxes


async def test_init_death_is_noticed_and_cleaned_up(stub, service):
    import json
    import os
    import signal

    sid = (await stub.Create(pb.CreateSandboxRequest())).sandbox_id
    box_dir = service.home / "sandbox" / "boxes" / sid
    pid = json.loads((box_dir / "state.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if (await stub.Get(pb.SandboxRef(sandbox_id=sid))).state == pb.SANDBOX_STATE_KILLED:
            break
        await asyncio.sleep(0.05)
    assert (await stub.Get(pb.SandboxRef(sandbox_id=sid))).state == pb.SANDBOX_STATE_KILLED
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await sh(stub, sid, "true")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "init process exited" in e.value.details()
    assert not box_dir.exists()
