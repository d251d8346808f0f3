"""Sandbox-executor benchmark, side by side with bubblewrap in one process.

    python bench/sandbox.py [--creates 40] [--execs 300] [--idle 1000] [--quick]

Measures, in-process against the real Manager (namespace backend, default
template) and against `bwrap --unshare-all` on the same root filesystem:
create -> first exec (cold and from the warm pool), exec round trip of `true`
(direct and through gRPC) against a bare fork/exec, pause/resume against
SIGSTOP/SIGCONT of a bwrap tree, fork x16 of a sandbox holding 10 MB in 1,000
files against copying that layer 16 times, and N idle sandboxes (memory per
sandbox, exec latency while they idle) against N idle bwrap sandboxes.
Writes bench/results/sandbox.json and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.grpc_server import ServiceServer, channel  # noqa: E402
from services.common.proto.rlyard.v1 import sandbox_pb2, sandbox_pb2_grpc  # noqa: E402
from services.sandbox import grpc_api  # noqa: E402
from services.sandbox.config import SandboxConfig  # noqa: E402
from services.sandbox.manager import Manager  # noqa: E402
from services.sandbox.templates import TemplateStore, default_home  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": round(statistics.median(values), 3), "p99_ms": round(pct(values, 0.99), 3),
            "mean_ms": round(statistics.fmean(values), 3)}


def mem_available_mb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable"):
            return int(line.split()[1]) / 1024
    return 0.0


class Bwrap:
    """bubblewrap with the same root filesystem, all namespaces unshared."""

    def __init__(self, rootfs: str) -> None:
        self.bin = shutil.which("bwrap")
        self.base = [self.bin or "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", rootfs, "/",
                     "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]

    async def run(self, *argv: str) -> bytes:
        proc = await asyncio.create_subprocess_exec(*self.base, *argv, stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
        return out

    def start(self, *argv: str) -> subprocess.Popen:
        return subprocess.Popen([*self.base, *argv], start_new_session=True)


async def timed(coro) -> float:
    t0 = time.perf_counter()
    await coro
    return (time.perf_counter() - t0) * 1000


async def bench_create(m_cold: Manager, m_warm: Manager, bw: Bwrap, n: int) -> dict:
    out: dict = {}
    for name, m in (("rlyard_cold", m_cold), ("rlyard_pool", m_warm)):
        times = []
        for _ in range(n):
            if m.config.pool_size:
                while len(m.pool.boxes) < m.config.pool_size:  # steady state: the pool refilled between requests
                    await asyncio.sleep(0.005)
            t0 = time.perf_counter()
            box = await m.create()
            res = await m.run(box.id, argv=["echo", "hi"])
            times.append((time.perf_counter() - t0) * 1000)
            assert res["stdout"] == b"hi\n", res
            await m.kill(box.id)
        out[name] = summary(times)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert await bw.run("echo", "hi") == b"hi\n"
        times.append((time.perf_counter() - t0) * 1000)
    out["bwrap"] = summary(times)

    # A burst: 16 sandboxes created and used at once (the zygote sets them up in one batch).
    async def one(m: Manager) -> None:
        box = await m.create()
        await m.run(box.id, argv=["echo", "hi"])
    burst = {"rlyard_cold": [], "bwrap": []}
    for _ in range(3):
        t0 = time.perf_counter()
        await asyncio.gather(*(one(m_cold) for _ in range(16)))
        burst["rlyard_cold"].append((time.perf_counter() - t0) * 1000)
        for box in list(m_cold.boxes.values()):
            await m_cold.kill(box.id)
        t0 = time.perf_counter()
        await asyncio.gather(*(bw.run("echo", "hi") for _ in range(16)))
        burst["bwrap"].append((time.perf_counter() - t0) * 1000)
    out["burst16"] = {k: summary(v) for k, v in burst.items()}
    return out


async def bench_exec(m: Manager, n: int) -> dict:
    box = await m.create()
    for _ in range(10):
        await m.run(box.id, argv=["true"])
    rl = [await timed(m.run(box.id, argv=["true"])) for _ in range(n)]

    async def spawn_true() -> None:
        p = await asyncio.create_subprocess_exec("/bin/true")
        await p.wait()
    bare_async = [await timed(spawn_true()) for _ in range(n)]
    bare_raw = []
    for _ in range(n):
        t0 = time.perf_counter()
        pid = os.posix_spawn("/bin/true", ["true"], {})
        os.waitpid(pid, 0)
        bare_raw.append((time.perf_counter() - t0) * 1000)
    # Through gRPC on loopback, servicer and client on this event loop.
    server = ServiceServer("127.0.0.1", 0)
    grpc_api.add_to(server, m)
    port = await server.start()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = sandbox_pb2_grpc.SandboxStub(ch)
            req = sandbox_pb2.ExecRequest(sandbox_id=box.id, argv=["true"])
            for _ in range(10):
                await stub.Exec(req)
            via_grpc = [await timed(stub.Exec(req)) for _ in range(n)]
    finally:
        await server.stop(0)
    await m.kill(box.id)
    return {"rlyard_exec": summary(rl), "rlyard_exec_grpc": summary(via_grpc),
            "bare_fork_exec_asyncio": summary(bare_async), "bare_posix_spawn": summary(bare_raw),
            "overhead_vs_bare_asyncio_p50_ms": round(statistics.median(rl) - statistics.median(bare_async), 3)}


async def bench_pause(m: Manager, bw: Bwrap, n: int) -> dict:
    box = await m.create()
    await m.run(box.id, shell="nohup sleep 1000 >/dev/null 2>&1 & nohup python3 -c 'import time; time.sleep(1000)' "
                               ">/dev/null 2>&1 &")
    pause, resume, first_exec = [], [], []
    for _ in range(n):
        pause.append(await timed(m.pause(box.id)))
        resume.append(await timed(m.resume(box.id)))
        first_exec.append(await timed(m.run(box.id, argv=["true"])))
    await m.kill(box.id)
    # Baseline: stop and continue a bwrap sandbox's process tree with signals (bwrap has no freezer).
    proc = bw.start("sh", "-c", "sleep 1000 & python3 -c 'import time; time.sleep(1000)' & wait")
    await asyncio.sleep(0.3)
    pgid = os.getpgid(proc.pid)

    def members() -> list[int]:
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.getpgid(int(d)) == pgid:
                        out.append(int(d))
                except ProcessLookupError:
                    pass
        return out

    def state(pid: int) -> str:
        try:
            data = open(f"/proc/{pid}/stat").read()
            return data[data.rindex(")") + 2]
        except OSError:
            return "X"

    stop, cont = [], []
    pids = members()
    for _ in range(n):
        t0 = time.perf_counter()
        os.killpg(pgid, signal.SIGSTOP)
        while any(state(p) not in "TX" for p in pids):
            await asyncio.sleep(0)
        stop.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        os.killpg(pgid, signal.SIGCONT)
        while any(state(p) == "T" for p in pids):
            await asyncio.sleep(0)
        cont.append((time.perf_counter() - t0) * 1000)
    os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    return {"rlyard_pause": summary(pause), "rlyard_resume": summary(resume),
            "rlyard_exec_after_resume": summary(first_exec),
            "bwrap_sigstop_tree": summary(stop), "bwrap_sigcont_tree": summary(cont)}


async def bench_fork(m: Manager, count: int = 16, rounds: int = 3) -> dict:
    box = await m.create()
    res = await m.run(box.id, shell="mkdir -p /data && cd /data && for i in $(seq 1000); do "
                                    "head -c 10240 /dev/urandom > f$i; done && du -sk /data", timeout_s=120)
    data_kb = int(res["stdout"].split()[0])
    fork_ms, ready_ms, copy_ms, snap_ms = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        children, ms = await m.fork(box.id, count)
        fork_ms.append(ms)
        results = await asyncio.gather(*(m.run(c.id, shell="ls /data | wc -l") for c in children))
        ready_ms.append((time.perf_counter() - t0) * 1000)
        assert all(r["stdout"] == b"1000\n" for r in results), results[0]
        for c in children:
            await m.kill(c.id)
        snap_ms.append((await m.snapshot(box.id))["duration_ms"])
        # Baseline: what a per-child copy of the same writable layer costs (no copy-on-write).
        with tempfile.TemporaryDirectory(dir=m.storage.layers) as tmp:
            await m.cgroups.set_frozen(box.id, True)
            t0 = time.perf_counter()
            for i in range(count):
                subprocess.run(["cp", "-a", str(m.storage.upper(box.id)), f"{tmp}/c{i}"], check=True)
            copy_ms.append((time.perf_counter() - t0) * 1000)
            await m.cgroups.set_frozen(box.id, False)
    await m.kill(box.id)
    for snap in m.storage.list_snapshots():
        m.delete_snapshot(snap["snapshot_id"])
    return {"children": count, "data_kb": data_kb, "rlyard_fork": summary(fork_ms),
            "rlyard_fork_until_all_children_answered": summary(ready_ms), "rlyard_snapshot": summary(snap_ms),
            "baseline_copy_layer_per_child": summary(copy_ms)}


async def bench_idle(m: Manager, bw: Bwrap, n: int) -> dict:
    base = mem_available_mb()
    boxes = []
    t0 = time.perf_counter()
    error = ""
    try:
        for i in range(n):
            boxes.append(await m.create(timeout_s=3600))
            if mem_available_mb() < 2048:
                error = f"stopped at {i + 1}: under 2 GiB of memory left"
                break
    except Exception as e:  # noqa: BLE001 - record how far it got
        error = f"stopped at {len(boxes)}: {e}"
    create_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    used = base - mem_available_mb()
    probe = [await timed(m.run(boxes[len(boxes) // 2].id, argv=["true"])) for _ in range(50)]
    cg_mem = sum(m.cgroups.memory_bytes(b.id) for b in boxes[:50]) / min(50, len(boxes)) / 2**20
    t0 = time.perf_counter()
    for b in boxes:
        await m.kill(b.id)
    kill_s = time.perf_counter() - t0
    rl = {"count": len(boxes), "create_total_s": round(create_s, 2), "kill_total_s": round(kill_s, 2),
          "host_mem_per_sandbox_mb": round(used / max(1, len(boxes)), 3),
          "cgroup_mem_per_sandbox_mb": round(cg_mem, 3), "exec_true_while_idle": summary(probe), "error": error}
    # Baseline: the same number of idle bwrap sandboxes.
    base = mem_available_mb()
    procs = []
    t0 = time.perf_counter()
    for _ in range(len(boxes)):
        procs.append(bw.start("sleep", "infinity"))
    start_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    used = base - mem_available_mb()
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    return {"rlyard": rl, "bwrap": {"count": len(procs), "start_total_s": round(start_s, 2),
                                    "host_mem_per_sandbox_mb": round(used / max(1, len(procs)), 3)}}


def bench_cgroup_attach(n: int = 10) -> dict:
    """What moving one process into a fresh memory cgroup costs (cgroup v1 waits for an RCU grace period);
    every cold sandbox pays it once, bubblewrap (no cgroups) never."""
    base = Path("/sys/fs/cgroup/memory") / f"rlyard-bench-attach-{os.getpid()}"
    times = []
    for i in range(n):
        group = base.with_name(f"{base.name}-{i}")
        group.mkdir()
        pid = os.fork()
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        try:
            time.sleep(0.05)
            t0 = time.perf_counter()
            (group / "cgroup.procs").write_text(str(pid))
            times.append((time.perf_counter() - t0) * 1000)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            group.rmdir()
    return summary(times)


def table(r: dict) -> str:
    rows = [("create -> first exec p50 / p99 (ms)",
             f"{r['create']['rlyard_pool']['p50_ms']:.1f} / {r['create']['rlyard_pool']['p99_ms']:.1f} (pool); "
             f"{r['create']['rlyard_cold']['p50_ms']:.1f} / {r['create']['rlyard_cold']['p99_ms']:.1f} (cold)",
             f"{r['create']['bwrap']['p50_ms']:.1f} / {r['create']['bwrap']['p99_ms']:.1f}"),
            ("of which: attach to a memory cgroup p50 (ms)", f"{r['cgroup_attach']['p50_ms']:.1f}", "(no cgroups)"),
            ("16 at once: create + first exec, all (ms)",
             f"{r['create']['burst16']['rlyard_cold']['p50_ms']:.0f} (cold)",
             f"{r['create']['burst16']['bwrap']['p50_ms']:.0f}"),
            ("exec `true` round trip p50 (ms)",
             f"{r['exec']['rlyard_exec']['p50_ms']:.2f} direct, {r['exec']['rlyard_exec_grpc']['p50_ms']:.2f} gRPC",
             f"{r['exec']['bare_fork_exec_asyncio']['p50_ms']:.2f} bare fork/exec "
             f"({r['exec']['bare_posix_spawn']['p50_ms']:.2f} posix_spawn)"),
            ("pause / resume p50 (ms)",
             f"{r['pause']['rlyard_pause']['p50_ms']:.2f} / {r['pause']['rlyard_resume']['p50_ms']:.2f} (freezer)",
             f"{r['pause']['bwrap_sigstop_tree']['p50_ms']:.2f} / {r['pause']['bwrap_sigcont_tree']['p50_ms']:.2f} "
             "(SIGSTOP/SIGCONT)"),
            (f"fork x{r['fork']['children']} of {r['fork']['data_kb'] / 1024:.0f} MB / 1,000 files p50 (ms)",
             f"{r['fork']['rlyard_fork']['p50_ms']:.0f} (all answered: "
             f"{r['fork']['rlyard_fork_until_all_children_answered']['p50_ms']:.0f})",
             f"{r['fork']['baseline_copy_layer_per_child']['p50_ms']:.0f} (cp -a per child)")]
    idle = r.get("idle")
    if idle:
        rows.append(("idle sandboxes: count, MB each (host)",
                     f"{idle['rlyard']['count']}, {idle['rlyard']['host_mem_per_sandbox_mb']:.2f} MB; exec p50 "
                     f"{idle['rlyard']['exec_true_while_idle']['p50_ms']:.2f} ms while idle",
                     f"{idle['bwrap']['count']}, {idle['bwrap']['host_mem_per_sandbox_mb']:.2f} MB"))
    w = [max(len(x[i]) for x in rows + [("metric", "rlyard", "bubblewrap")]) for i in range(3)]
    lines = [" | ".join(h.ljust(w[i]) for i, h in enumerate(("metric", "rlyard", "bubblewrap"))),
             "-+-".join("-" * x for x in w)]
    lines += [" | ".join(c.ljust(w[i]) for i, c in enumerate(row)) for row in rows]
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--creates", type=int, default=40)
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--pauses", type=int, default=50)
    ap.add_argument("--idle", type=int, default=1000, help="idle sandboxes to hold at once (0 = skip)")
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sandbox.json"))
    args = ap.parse_args()
    if args.quick:
        args.creates, args.execs, args.pauses, args.idle = 10, 50, 10, 50
    if os.geteuid() != 0:
        sys.exit("the namespace backend needs root")
    tpl = TemplateStore().get("default")
    bw = Bwrap(str(tpl.rootfs))
    if bw.bin is None:
        sys.exit("bubblewrap is missing: apt-get install -y bubblewrap")
    home = Path(tempfile.mkdtemp(prefix="rlyard-bench-"))
    (home / "templates").symlink_to(default_home() / "templates")
    cold = Manager(SandboxConfig(home=home / "cold", max_sandboxes=max(100, args.idle + 10), pool_size=0))
    (home / "cold").mkdir()
    (home / "cold" / "templates").symlink_to(default_home() / "templates")
    warm = Manager(SandboxConfig(home=home, max_sandboxes=max(100, args.idle + 10), pool_size=4))
    await cold.start()
    await warm.start()
    result: dict = {"machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                                "load_avg_at_start": os.getloadavg(), "bwrap": subprocess.run(
                                    [bw.bin, "--version"], capture_output=True, text=True).stdout.strip()},
                    "template": str(tpl.rootfs)}
    try:
        result["cgroup_attach"] = bench_cgroup_attach()
        result["create"] = await bench_create(cold, warm, bw, args.creates)
        print("create done", flush=True)
        result["exec"] = await bench_exec(cold, args.execs)
        print("exec done", flush=True)
        result["pause"] = await bench_pause(cold, bw, args.pauses)
        print("pause done", flush=True)
        result["fork"] = await bench_fork(cold)
        print("fork done", flush=True)
        if args.idle:
            result["idle"] = await bench_idle(cold, bw, args.idle)
            print("idle done", flush=True)
    finally:
        await warm.stop(kill_all=True)
        await cold.stop(kill_all=True)
        shutil.rmtree(home, ignore_errors=True)
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
