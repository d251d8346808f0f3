"""Sandbox-executor benchmark, side by side with bubblewrap in one process.

    python bench/sandbox.py [--creates 40] [--execs 300] [--idle 1000] [--quick] [--only create,exec,...]

Measures, in-process against the real Manager (namespace backend, default
template) and against `bwrap --unshare-all` on the same root filesystem:
create -> first exec (cold, from the warm pool, from the blank pool), exec
round trip of `true` (direct, through gRPC, and with the init forking instead
of the exec helper) against a bare fork/exec, pause/resume against
SIGSTOP/SIGCONT of a bwrap tree, fork x16 of a sandbox holding 10 MB in 1,000
files (with and without the blank pool) against copying that layer 16 times,
and N idle sandboxes (memory per sandbox, exec latency while they idle)
against N idle bwrap sandboxes. Variants of one measurement are interleaved
per iteration, so that load from other work hits them alike; the load
average is recorded. Writes bench/results/sandbox.json and prints a table.
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


# Quiet time after the pool refilled before a timed create (the refill must not share the CPU with it).
POOL_REFILL_QUIET_S = 0.05


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


async def pools_full(*managers: Manager) -> None:
    """Steady state: every manager's pools refilled (refills wait for quiet moments, and must not run during
    the next timed request, of whichever variant), then a short pause."""
    for m in managers:
        while len(m.pool.boxes) < m.config.pool_size or len(m.blanks.boxes) < m.blanks.size:
            await asyncio.sleep(0.005)
    await asyncio.sleep(POOL_REFILL_QUIET_S)


async def bench_create(m_cold: Manager, m_warm: Manager, m_blank: Manager, bw: Bwrap, n: int) -> dict:
    out: dict = {}
    times: dict[str, list[float]] = {"rlyard_cold": [], "rlyard_pool": [], "rlyard_blank": [], "bwrap": []}
    handout: dict[str, list[float]] = {"rlyard_cold": [], "rlyard_pool": [], "rlyard_blank": []}
    # Interleaved per iteration, so that load changes hit every variant alike.
    everyone = (m_cold, m_warm, m_blank)
    for _ in range(n):
        for name, m in (("rlyard_cold", m_cold), ("rlyard_pool", m_warm), ("rlyard_blank", m_blank)):
            await pools_full(*everyone)
            t0 = time.perf_counter()
            box = await m.create()
            t1 = time.perf_counter()
            res = await m.run(box.id, argv=["echo", "hi"])
            times[name].append((time.perf_counter() - t0) * 1000)
            handout[name].append((t1 - t0) * 1000)
            assert res["stdout"] == b"hi\n", res
            await m.kill(box.id)
        await pools_full(*everyone)
        t0 = time.perf_counter()
        assert await bw.run("echo", "hi") == b"hi\n"
        times["bwrap"].append((time.perf_counter() - t0) * 1000)
    out = {k: summary(v) for k, v in times.items()}
    out["phases"] = {f"{k}_create_call": summary(v) for k, v in handout.items()}
    out["note"] = ("create -> `echo hi` answered. rlyard_pool: the warm pool (--pool-size 4) holds started sandboxes "
                   "of the default template (namespaces, overlay root, cgroups joined, init serving, one `bash -c "
                   "true` run); create hands one over. rlyard_blank: warm pool off, the blank pool (--blank-pool "
                   "16) holds sandboxes started but for their root filesystem (any template or snapshot); create "
                   "sends one its layers. rlyard_cold: both pools off, everything done on request.")

    # A burst: 16 sandboxes created and used at once (cold: the zygote sets them up in one batch;
    # blank: 16 blanks from the pool, refilled and waited for before each burst).
    async def one(m: Manager) -> None:
        box = await m.create()
        await m.run(box.id, argv=["echo", "hi"])
    burst: dict[str, list[float]] = {"rlyard_cold": [], "rlyard_blank": [], "bwrap": []}
    for _ in range(3):
        for name, m in (("rlyard_cold", m_cold), ("rlyard_blank", m_blank)):
            await pools_full(*everyone)
            t0 = time.perf_counter()
            await asyncio.gather(*(one(m) for _ in range(16)))
            burst[name].append((time.perf_counter() - t0) * 1000)
            for box in list(m.boxes.values()):
                await m.kill(box.id)
        await pools_full(*everyone)
        t0 = time.perf_counter()
        await asyncio.gather(*(bw.run("echo", "hi") for _ in range(16)))
        burst["bwrap"].append((time.perf_counter() - t0) * 1000)
    out["burst16"] = {k: summary(v) for k, v in burst.items()}
    return out


async def bench_exec(m: Manager, m_fork: Manager, n: int) -> dict:
    """Round trips of `true`, the variants interleaved per iteration so that load changes hit all alike."""
    box = await m.create()
    fbox = await m_fork.create()

    async def spawn_true() -> None:
        p = await asyncio.create_subprocess_exec("/bin/true")
        await p.wait()

    def posix_spawn_true() -> None:
        pid = os.posix_spawn("/bin/true", ["true"], {})
        os.waitpid(pid, 0)

    async def raw() -> None:
        posix_spawn_true()

    # Through gRPC on loopback, servicer and client on this event loop.
    server = ServiceServer("127.0.0.1", 0)
    grpc_api.add_to(server, m)
    port = await server.start()
    times: dict[str, list[float]] = {"rlyard_exec": [], "rlyard_exec_grpc": [], "rlyard_exec_fork_fallback": [],
                                     "bare_fork_exec_asyncio": [], "bare_posix_spawn": []}
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = sandbox_pb2_grpc.SandboxStub(ch)
            req = sandbox_pb2.ExecRequest(sandbox_id=box.id, argv=["true"])
            variants = {"rlyard_exec": lambda: m.run(box.id, argv=["true"]),
                        "rlyard_exec_grpc": lambda: stub.Exec(req),
                        "rlyard_exec_fork_fallback": lambda: m_fork.run(fbox.id, argv=["true"]),
                        "bare_fork_exec_asyncio": spawn_true, "bare_posix_spawn": raw}
            for _ in range(10):
                for f in variants.values():
                    await f()
            for _ in range(n):
                for name, f in variants.items():
                    times[name].append(await timed(f()))
    finally:
        await server.stop(0)
    await m.kill(box.id)
    await m_fork.kill(fbox.id)
    out = {k: summary(v) for k, v in times.items()}
    bare = statistics.median(times["bare_fork_exec_asyncio"])
    out["overhead_vs_bare_asyncio_p50_ms"] = round(statistics.median(times["rlyard_exec"]) - bare, 3)
    out["overhead_grpc_vs_bare_asyncio_p50_ms"] = round(statistics.median(times["rlyard_exec_grpc"]) - bare, 3)
    out["note"] = ("rlyard_exec: Manager.run in-process; the init starts the command through posix_spawn of the exec "
                   "helper. rlyard_exec_fork_fallback: the same with --exec-helper off (the init forks). "
                   "bare_fork_exec_asyncio: asyncio.create_subprocess_exec('/bin/true') from this process.")
    return out


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


def _timing(obj: object, name: str, into: list[float]) -> None:
    """Wrap the coroutine method `obj.name` so that each call's duration (ms) is appended to `into`."""
    inner = getattr(obj, name)

    async def timed_call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return await inner(*a, **kw)
        finally:
            into.append((time.perf_counter() - t0) * 1000)
    setattr(obj, name, timed_call)


async def bench_fork(m: Manager, count: int = 16, rounds: int = 5, baseline_rounds: int = 2) -> dict:
    box = await m.create()
    res = await m.run(box.id, shell="mkdir -p /data && cd /data && for i in $(seq 1000); do "
                                    "head -c 10240 /dev/urandom > f$i; done && du -sk /data", timeout_s=120)
    data_kb = int(res["stdout"].split()[0])
    fork_ms, ready_ms, copy_ms, snap_ms = [], [], [], []
    seal_ms: list[float] = []   # parent frozen, writable layer copied, parent thawed
    spawn_ms: list[float] = []  # the zygote starting children from scratch (after the copy), until every init serves
    calls: dict[str, list[float]] = {"seal": [], "spawn_many": []}
    _timing(m.storage, "seal", calls["seal"])
    _timing(m.spawner, "spawn_many", calls["spawn_many"])
    for round_no in range(rounds):
        await asyncio.sleep(0.2)  # let the previous round's teardown (namespaces, mounts) finish
        await pools_full(m)
        for v in calls.values():
            v.clear()
        t0 = time.perf_counter()
        children, ms = await m.fork(box.id, count)
        fork_ms.append(ms)
        seal_ms += calls["seal"]
        spawn_ms += calls["spawn_many"]
        results = await asyncio.gather(*(m.run(c.id, shell="ls /data | wc -l") for c in children))
        ready_ms.append((time.perf_counter() - t0) * 1000)
        assert all(r["stdout"] == b"1000\n" for r in results), results[0]
        for c in children:
            await m.kill(c.id)
        snap_ms.append((await m.snapshot(box.id))["duration_ms"])
        if round_no >= baseline_rounds:
            continue
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
            "blank_pool": m.blanks.size,
            "phases": {"seal_copy_frozen": summary(seal_ms),
                       **({"spawn_children": summary(spawn_ms)} if spawn_ms else {})},
            **({"baseline_copy_layer_per_child": summary(copy_ms)} if copy_ms else {}),
            "note": ("rlyard_fork: Fork RPC until all children's inits serve (each child usable: its control "
                     "socket accepts commands); the children's folders, quotas and cgroups are made while the "
                     "parent's layer is copied. until_all_children_answered: plus one `ls /data | wc -l` in every "
                     "child, all at once. With a blank pool (waited for full before each round) the children are "
                     "blank sandboxes given the sealed layer; without, the zygote starts them.")}


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
    rows: list[tuple[str, str, str]] = []
    if "create" in r:
        c = r["create"]
        rows += [("create -> first exec p50 / p99 (ms)",
                  f"{c['rlyard_pool']['p50_ms']:.1f} / {c['rlyard_pool']['p99_ms']:.1f} (pool); "
                  f"{c['rlyard_blank']['p50_ms']:.1f} / {c['rlyard_blank']['p99_ms']:.1f} (blank); "
                  f"{c['rlyard_cold']['p50_ms']:.1f} / {c['rlyard_cold']['p99_ms']:.1f} (cold)",
                  f"{c['bwrap']['p50_ms']:.1f} / {c['bwrap']['p99_ms']:.1f}"),
                 ("of which: the create call p50 (ms)",
                  f"{c['phases']['rlyard_pool_create_call']['p50_ms']:.2f} (pool); "
                  f"{c['phases']['rlyard_blank_create_call']['p50_ms']:.1f} (blank); "
                  f"{c['phases']['rlyard_cold_create_call']['p50_ms']:.1f} (cold)", ""),
                 ("attach to a memory cgroup p50 (ms; cold only)", f"{r['cgroup_attach']['p50_ms']:.1f}",
                  "(no cgroups)"),
                 ("16 at once: create + first exec, all (ms)",
                  f"{c['burst16']['rlyard_blank']['p50_ms']:.0f} (blank); "
                  f"{c['burst16']['rlyard_cold']['p50_ms']:.0f} (cold)",
                  f"{c['burst16']['bwrap']['p50_ms']:.0f}")]
    if "exec" in r:
        e = r["exec"]
        rows += [("exec `true` round trip p50 (ms)",
                  f"{e['rlyard_exec']['p50_ms']:.2f} direct, {e['rlyard_exec_grpc']['p50_ms']:.2f} gRPC "
                  f"({e['rlyard_exec_fork_fallback']['p50_ms']:.2f} with the init forking)",
                  f"{e['bare_fork_exec_asyncio']['p50_ms']:.2f} bare fork/exec "
                  f"({e['bare_posix_spawn']['p50_ms']:.2f} posix_spawn)"),
                 ("exec overhead over bare fork/exec p50 (ms)",
                  f"{e['overhead_vs_bare_asyncio_p50_ms']:.2f} direct, {e['overhead_grpc_vs_bare_asyncio_p50_ms']:.2f} "
                  "gRPC", "")]
    if "pause" in r:
        p = r["pause"]
        rows.append(("pause / resume p50 (ms)",
                     f"{p['rlyard_pause']['p50_ms']:.2f} / {p['rlyard_resume']['p50_ms']:.2f} (freezer)",
                     f"{p['bwrap_sigstop_tree']['p50_ms']:.2f} / {p['bwrap_sigcont_tree']['p50_ms']:.2f} "
                     "(SIGSTOP/SIGCONT)"))
    if "fork" in r:
        f = r["fork"]
        rows += [(f"fork x{f['children']} of {f['data_kb'] / 1024:.0f} MB / 1,000 files p50 (ms)",
                  f"{f['rlyard_fork']['p50_ms']:.0f} (all answered: "
                  f"{f['rlyard_fork_until_all_children_answered']['p50_ms']:.0f})",
                  f"{f['baseline_copy_layer_per_child']['p50_ms']:.0f} (cp -a per child)"),
                 ("of which: layer copy, parent frozen p50 (ms)", f"{f['phases']['seal_copy_frozen']['p50_ms']:.0f}", "")]
        nb = f.get("without_blank_pool")
        if nb:
            rows.append(("fork x16 without the blank pool p50 (ms)",
                         f"{nb['rlyard_fork']['p50_ms']:.0f} (all answered: "
                         f"{nb['rlyard_fork_until_all_children_answered']['p50_ms']:.0f}; children start "
                         f"{nb['phases']['spawn_children']['p50_ms']:.0f})", ""))
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
    ap.add_argument("--only", default="", help="comma-separated sections to run (create, exec, pause, fork, idle); "
                                               "default all")
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
    limit = max(100, args.idle + 10)

    def manager(name: str, **kw) -> Manager:
        (home / name).mkdir()
        (home / name / "templates").symlink_to(default_home() / "templates")
        return Manager(SandboxConfig(home=home / name, max_sandboxes=limit, **kw))
    # cold: nothing pre-started. warm: the warm pool (4 started sandboxes of the default template).
    # blanks: the blank pool (16 sandboxes started but for their root). forking: commands by fork, no helper.
    cold = manager("cold", pool_size=0, blank_pool=0)
    warm = manager("warm", pool_size=4, blank_pool=0)
    blanks = manager("blanks", pool_size=0, blank_pool=16)
    forking = manager("forking", pool_size=0, blank_pool=0, exec_helper="off")
    for m in (cold, warm, blanks, forking):
        await m.start()
    only = {x.strip() for x in args.only.split(",") if x.strip()}

    async def wanted(section: str) -> bool:
        if only and section not in only:
            return False
        await pools_full(cold, warm, blanks, forking)  # no refill left running into the next section
        return True
    result: dict = {"machine": {"kernel": platform.release(), "cpus": os.cpu_count(),
                                "load_avg_at_start": os.getloadavg(), "bwrap": subprocess.run(
                                    [bw.bin, "--version"], capture_output=True, text=True).stdout.strip()},
                    "template": str(tpl.rootfs)}
    try:
        if await wanted("create"):
            result["cgroup_attach"] = bench_cgroup_attach()
            result["create"] = await bench_create(cold, warm, blanks, bw, args.creates)
            print("create done", flush=True)
        if await wanted("exec"):
            result["exec"] = await bench_exec(cold, forking, args.execs)
            print("exec done", flush=True)
        if await wanted("pause"):
            result["pause"] = await bench_pause(cold, bw, args.pauses)
            print("pause done", flush=True)
        if await wanted("fork"):
            result["fork"] = await bench_fork(blanks)
            result["fork"]["without_blank_pool"] = await bench_fork(cold, baseline_rounds=0)
            print("fork done", flush=True)
        if args.idle and await wanted("idle"):
            result["idle"] = await bench_idle(cold, bw, args.idle)
            print("idle done", flush=True)
    finally:
        for m in (forking, blanks, warm, cold):
            await m.stop(kill_all=True)
        shutil.rmtree(home, ignore_errors=True)
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
