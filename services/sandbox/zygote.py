"""The zygote: a small single-threaded helper that forks every sandbox's init.

The service starts it once (`python -S -m services.sandbox.zygote`) and sends
it one JSON request per line on stdin; it answers one JSON line on stdout. A
spawn forks a middle process that joins the sandbox's cgroups, binds the
control socket and unshares the namespaces, then forks the init (PID 1 of the
new pid namespace), which mounts the overlay root, /proc, /dev and /tmp,
brings up loopback, pivots into the root, drops capabilities and serves.
A blank spawn (blank_pool.py) stops before the root: /proc, /dev and /tmp
are mounted in a staging folder and the init waits on its socket for the
layers ("attach"), then mounts the overlay, moves them in, pivots and locks
down as above. Forking from this pre-imported process, not from the
multi-threaded gRPC service, keeps a spawn at a few milliseconds and lets
every init share the zygote's memory pages copy-on-write.

Standard library only.
"""
from __future__ import annotations

import bz2  # noqa: F401 - preloaded: tarfile imports compressors lazily, after pivot_root they are gone
import encodings.ascii  # noqa: F401
import encodings.latin_1  # noqa: F401
import encodings.utf_8  # noqa: F401
import fcntl
import gc
import gzip  # noqa: F401
import json
import lzma  # noqa: F401
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback

from services.sandbox import egress_relay, linux, seccomp, wire
from services.sandbox.init import Init, read_frame

DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
MASKED = ("kcore", "sysrq-trigger", "timer_list", "keys", "kmsg", "latency_stats", "sched_debug")
READ_ONLY = ("sys", "irq", "bus", "fs")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# The mounts a sandbox gets besides its root, each with its submounts (moved as a whole by a blank's attach).
SPECIAL_MOUNTS = ("proc", "dev", "tmp")


def _mount_overlay(req: dict, lowers: list[str]) -> str:
    """Mount the overlay root (read-only `lowers`, top first, under the sandbox's writable layer) at req['root']."""
    root = req["root"]
    opts = f"lowerdir={':'.join(lowers)},upperdir={req['upper']},workdir={req['work']}"
    if req.get("userns"):
        opts += ",userxattr"
    # nodev: device nodes work only on /dev (a separate tmpfs holding bind mounts of the safe ones).
    linux.mount("overlay", root, "overlay", linux.MS_NODEV, opts)
    return root


def _mount_specials(base: str, req: dict) -> None:
    """Fresh /proc (masked, partly read-only), a minimal /dev and /tmp under `base`."""
    nosuid = linux.MS_NOSUID | linux.MS_NODEV
    linux.mount("proc", f"{base}/proc", "proc", nosuid | linux.MS_NOEXEC)
    dev = f"{base}/dev"
    linux.mount("tmpfs", dev, "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "mode=755,size=256k")
    for node in DEV_NODES:
        open(f"{dev}/{node}", "w").close()
        linux.mount(f"/dev/{node}", f"{dev}/{node}", None, linux.MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/pts")
    linux.mount("devpts", f"{dev}/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=620")
    os.mkdir(f"{dev}/shm")
    linux.mount("tmpfs", f"{dev}/shm", "tmpfs", nosuid, "mode=1777,size=64m")
    linux.mount("tmpfs", f"{base}/tmp", "tmpfs", nosuid, f"mode=1777,size={int(req.get('tmp_mb') or 256)}m")
    for name in MASKED:
        if os.path.exists(f"{base}/proc/{name}"):
            linux.mount(f"{dev}/null", f"{base}/proc/{name}", None, linux.MS_BIND)
    for name in READ_ONLY:
        p = f"{base}/proc/{name}"
        if os.path.isdir(p):
            linux.mount(p, p, None, linux.MS_BIND | linux.MS_REC)
            linux.mount(None, p, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_REC)


def _mount_root(req: dict) -> str:
    """Mount the sandbox's filesystem tree under req['root'] (in the new mount namespace)."""
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    root = _mount_overlay(req, req["lowers"])
    _mount_specials(root, req)
    if req.get("egress_dir"):
        os.makedirs(f"{root}/run/rlyard", exist_ok=True)
        linux.mount(req["egress_dir"], f"{root}/run/rlyard", None, linux.MS_BIND)
    return root


def _attach_root(req: dict, lowers: list[str]) -> str:
    """A blank's second half: mount the overlay root, then move the staged /proc, /dev and /tmp into it."""
    if not lowers or not all(isinstance(x, str) and x.startswith("/") for x in lowers):
        raise ValueError("attach needs the absolute paths of the read-only layers")
    root = _mount_overlay(req, lowers)
    for name in SPECIAL_MOUNTS:
        linux.mount(f"{req['stage']}/{name}", f"{root}/{name}", None, linux.MS_MOVE)
    return root


def _await_attach(listener: socket.socket) -> tuple[socket.socket, list[str]]:
    """Block until the service sends this blank its layers (op "attach"); other requests are refused."""
    while True:
        conn, _ = listener.accept()
        conn.settimeout(30)
        try:
            _, payload = read_frame(conn)
            req = json.loads(payload)
            if isinstance(req, dict) and req.get("op") == "attach" and isinstance(req.get("lowers"), list):
                return conn, req["lowers"]
            conn.sendall(wire.json_frame(wire.REPLY, {"ok": False, "code": "failed_precondition",
                                                      "message": "this sandbox is not started yet"}))
        except (OSError, ValueError, EOFError):
            pass
        conn.close()


def _lock_down(req: dict, bounding_dropped: bool = False) -> None:
    """Pivot into the mounted root and drop privileges: nothing after this can mount or widen them."""
    root = req["root"]
    os.chdir(root)
    linux.pivot_root(".", ".")
    linux.umount2(".", linux.MNT_DETACH)
    os.chdir("/")
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    linux.drop_capabilities(bounding=not bounding_dropped)
    seccomp.install()


def _set_rlimits(req: dict) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, value in (req.get("rlimits") or {}).items():
        lim = getattr(resource, f"RLIMIT_{name.upper()}")
        hard = resource.getrlimit(lim)[1]
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        try:
            resource.setrlimit(lim, (value, value))
        except (ValueError, OSError):
            resource.setrlimit(lim, (min(value, hard), hard))


def _protect_from_oom() -> None:
    """A memory bomb in the sandbox should take down the bomb, not the init (which would end the sandbox)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-999")
    except OSError:
        pass  # needs CAP_SYS_RESOURCE (absent when rootless); commands still get a higher score than the init


def _wait_joined(join_r: int) -> None:
    """Block until the middle process has moved this process into the sandbox's cgroups."""
    if os.read(join_r, 1) != b"j":
        raise RuntimeError("could not join the sandbox's cgroups")
    os.close(join_r)


def _open_helper(path: str) -> int:
    """The exec helper, kept open (close-on-exec, above the fds a command gets) so that it stays reachable
    after pivot_root as /proc/self/fd/N; -1 without one."""
    if not path:
        return -1
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def _init_main(req: dict, ready_w: int, listener: socket.socket, join_r: int) -> None:
    """Runs as the sandbox's init; never returns. No command runs before it has joined its cgroups."""
    blank = False
    try:
        linux.set_process_name("rlyard-init")
        helper_fd = _open_helper(req.get("exec_helper") or "")
        backend = req["backend"]
        if backend == "process":
            base = req["base"]
            os.makedirs(base, exist_ok=True)
            os.chdir(base)
            _set_rlimits(req)
            linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
            _wait_joined(join_r)
            init = Init(listener, home="/", base=base, helper_fd=helper_fd)
        elif req.get("blank"):
            # Everything but the root filesystem, which the attach brings (see _finish_blank).
            linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
            _mount_specials(req["stage"], req)
            _prepare_process(req, join_r)
            linux.drop_bounding()  # the mounts still to come need only the effective set
            init = Init(listener, home=req.get("home") or "/root", helper_fd=helper_fd)
            blank = True
        else:
            _mount_root(req)
            _prepare_process(req, join_r)
            _lock_down(req)
            if req.get("egress_dir"):
                egress_relay.start(3128, "/run/rlyard/egress.sock")
            init = Init(listener, home=req.get("home") or "/root", helper_fd=helper_fd)
        linux.prctl(linux.PR_SET_DUMPABLE, 0)
        os.write(ready_w, b"ok\n")
        os.close(ready_w)
    except BaseException as e:  # noqa: BLE001 - report to the zygote, then die
        detail = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " ")
        try:
            os.write(ready_w, f"err init setup failed: {detail}\n".encode())
        finally:
            os._exit(1)
    try:
        if blank:
            _finish_blank(req, listener)
        init.serve()
    finally:
        os._exit(0)


def _prepare_process(req: dict, join_r: int) -> None:
    """Hostname, loopback, limits; then wait to be in the sandbox's cgroups and make that the cgroup root."""
    linux.sethostname(req.get("hostname") or "sandbox")
    linux.loopback_up()
    _set_rlimits(req)
    _protect_from_oom()
    _wait_joined(join_r)
    linux.unshare(linux.CLONE_NEWCGROUP)  # after joining: the sandbox's own group is its cgroup root


def _finish_blank(req: dict, listener: socket.socket) -> None:
    """A blank sandbox's init waits for its layers, mounts its root, locks down and answers the attach."""
    conn, lowers = _await_attach(listener)
    try:
        _attach_root(req, lowers)
        _lock_down(req, bounding_dropped=True)
        conn.sendall(wire.json_frame(wire.REPLY, {"ok": True}))
        conn.close()
    except BaseException as e:  # noqa: BLE001 - report to the service, then die (the sandbox is unusable)
        detail = "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " ")
        try:
            conn.sendall(wire.json_frame(wire.REPLY, {"ok": False, "code": "internal",
                                                      "message": f"sandbox root setup failed: {detail}"}))
        finally:
            os._exit(1)


def _middle(req: dict, ready_w: int) -> None:
    """Binds the socket, unshares, forks the init, then moves the init into the sandbox's cgroups while
    it sets itself up (a cgroup v1 move waits for an RCU grace period, ~10 ms: overlapped, not added);
    never returns."""
    try:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        os.setsid()
        sock = req["sock"]
        if os.path.lexists(sock):
            os.unlink(sock)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(sock)
        os.chmod(sock, 0o600)
        listener.listen(256)
        # Opened now: once the init pivots, this (shared) mount namespace no longer shows /sys/fs/cgroup.
        procs = [os.open(f"{cg}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) for cg in req.get("cgroups") or []]
        backend = req["backend"]
        flags = linux.NS_FLAGS & ~linux.CLONE_NEWCGROUP  # the init unshares it once it has joined
        if backend == "namespace":
            linux.unshare(flags)
        elif backend == "userns":
            uid, gid = os.geteuid(), os.getegid()
            linux.unshare(flags | linux.CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        join_r, join_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(join_w)
            for fd in procs:
                os.close(fd)
            _init_main(req, ready_w, listener, join_r)
        os.close(join_r)
        os.write(ready_w, f"pid {pid}\n".encode())
        for fd in procs:
            os.write(fd, str(pid).encode())
            os.close(fd)
        os.write(join_w, b"j")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(ready_w, f"err sandbox setup failed: {e}\n".encode())
        finally:
            os._exit(1)


def spawn_many(reqs: list[dict]) -> list[dict]:
    """Fork every sandbox's middle process first, then collect their reports, so set-ups run in parallel."""
    pending: dict[int, dict] = {}
    results: list[dict] = [{} for _ in reqs]
    for i, req in enumerate(reqs):
        ready_r, ready_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(ready_r)
            _middle(req, ready_w)
        os.close(ready_w)
        pending[ready_r] = {"i": i, "middle": middle, "buf": b""}
    deadline = time.monotonic() + max(float(r.get("setup_timeout") or 20) for r in reqs)
    while pending:
        left = deadline - time.monotonic()
        readable = select.select(list(pending), [], [], max(0.0, left))[0] if left > 0 else []
        if not readable:
            for fd, st in pending.items():
                st["buf"] += b"\nerr sandbox setup timed out\n"
            readable = list(pending)
            done = readable
        else:
            done = []
            for fd in readable:
                chunk = os.read(fd, 4096)
                if chunk:
                    pending[fd]["buf"] += chunk
                else:
                    done.append(fd)
        for fd in done:
            st = pending.pop(fd)
            os.close(fd)
            try:
                os.waitpid(st["middle"], 0)
            except ChildProcessError:
                pass  # already reaped by the SIGCHLD handler
            results[st["i"]] = _outcome(st["buf"])
    return results


def _outcome(buf: bytes) -> dict:
    pid, ok, errors = None, False, []
    for line in buf.decode(errors="replace").splitlines():
        if line.startswith("pid "):
            pid = int(line[4:])
        elif line == "ok":
            ok = True
        elif line.startswith("err "):
            errors.append(line[4:])
    error = "; ".join(errors)
    if ok and pid and not error:
        return {"ok": True, "pid": pid}
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"ok": False, "error": error or "sandbox init exited during setup"}


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    linux.set_process_name("rlyard-zygote")
    # Every init is a fork of this process: keep the collector off the inherited objects, so they stay
    # shared copy-on-write instead of being touched (and copied) by each init's first collection.
    gc.freeze()
    # Inits are orphaned when their middle process exits; as subreaper the zygote inherits and reaps them.
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Reap dead inits at once, so the service sees their pid vanish without waiting for a poll.
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    stdin = sys.stdin.buffer
    out = sys.stdout
    buf = b""
    fd = stdin.fileno()
    while True:
        r, _, _ = select.select([fd], [], [], 1.0)
        _reap()
        if not r:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = None
            try:
                req = json.loads(line)
                if req.get("op") == "spawn_many":
                    reply = {"ok": True, "results": spawn_many(req["requests"])}
                else:
                    reply = {"ok": True, "pong": os.getpid()}
            except Exception as e:  # noqa: BLE001 - one bad request must not end the zygote
                reply = {"ok": False, "error": f"zygote: {e}"}
            reply["seq"] = req.get("seq") if isinstance(req, dict) else None
            out.write(json.dumps(reply) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
