"""A service restart re-adopts live sandboxes, cleans up dead ones, and leaves nothing behind at the end."""
from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

from services.common.grpc_server import channel
from services.common.proto.rlyard.v1 import sandbox_pb2 as pb, sandbox_pb2_grpc
from tests.sandbox.conftest import need_namespace_backend, sh, start_service


def leftovers(home: Path, pids: list[int]) -> dict:
    """Mounts, cgroups and processes a service with state in `home` may have left."""
    state = str((home / "sandbox").resolve())
    mounts = [line.split()[4] for line in open("/proc/self/mountinfo") if state in line.split()[4]]
    tag = hashlib.sha1(state.encode()).hexdigest()[:8]
    groups = [c for c in ("memory", "pids", "cpu", "cpuacct", "freezer")
              if Path(f"/sys/fs/cgroup/{c}/rlyard-{tag}").exists()]
    alive = []
    for pid in pids:
        try:
            st = open(f"/proc/{pid}/stat").read()
            if st[st.rindex(")") + 2] not in "ZX":
                alive.append(pid)
        except OSError:
            pass
    sockets = [str(p) for d in ("/run", "/tmp") for p in Path(d).glob(f"rlyard-*-{tag}")]
    return {"mounts": mounts, "cgroups": groups, "processes": alive, "sockets": sockets}


def init_pids(home: Path) -> list[int]:
    import json
    out = []
    for d in (home / "sandbox" / "boxes").iterdir():
        try:
            out.append(json.loads((d / "state.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return out


async def test_restart_readopts_and_cleans_up(tmp_path):
    need_namespace_backend()
    home = tmp_path / "home"
    first = start_service(home, "--on-exit", "keep")
    try:
        async with channel(first.target) as ch:
            stub = sandbox_pb2_grpc.SandboxStub(ch)
            running = (await stub.Create(pb.CreateSandboxRequest())).sandbox_id
            paused = (await stub.Create(pb.CreateSandboxRequest())).sandbox_id
            doomed = (await stub.Create(pb.CreateSandboxRequest())).sandbox_id
            await sh(stub, running, "echo before > /root/f; nohup sleep 900 >/dev/null 2>&1 &")
            await stub.Pause(pb.SandboxRef(sandbox_id=paused))
        pids = init_pids(home)
        assert len(pids) >= 3  # plus the warm pool's sandboxes
    finally:
        first.stop(signal.SIGKILL)  # a crash: no chance to clean up
    doomed_pid = next(p for p in pids if f"{p}" in open(home / "sandbox" / "boxes" / doomed / "state.json").read())
    os.kill(doomed_pid, signal.SIGKILL)  # this one dies while no service watches
    time.sleep(0.2)

    second = start_service(home, "--on-exit", "kill")
    try:
        async with channel(second.target) as ch:
            stub = sandbox_pb2_grpc.SandboxStub(ch)
            listed = {s.sandbox_id: s.state for s in (await stub.List(pb.ListSandboxesRequest())).sandboxes}
            assert listed == {running: pb.SANDBOX_STATE_RUNNING, paused: pb.SANDBOX_STATE_PAUSED}
            r = await sh(stub, running, "cat /root/f; pgrep -c -x sleep")
            assert r.stdout == b"before\n1\n"
            await stub.Resume(pb.SandboxRef(sandbox_id=paused))
            assert (await sh(stub, paused, "echo back")).stdout == b"back\n"
        assert not (home / "sandbox" / "boxes" / doomed).exists()
    finally:
        assert second.stop() == 0
    assert leftovers(home, pids) == {"mounts": [], "cgroups": [], "processes": [], "sockets": []}
    assert list((home / "sandbox" / "boxes").iterdir()) == []
