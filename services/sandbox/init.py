"""The sandbox's init: PID 1 inside the sandbox, reaping zombies and serving the control socket.

One select loop, no threads. Each connection carries one request: an exec
(the reply streams the output: head chunks, then the kept tail, then the exit
status) or a file operation (one JSON reply, optionally followed by data).
Commands run in their own session as child subreapers, so a timeout can stop
and kill the whole tree, `setsid` and double-forked orphans included.

Standard library only: everything is imported before `pivot_root`, after which
the host's Python library is no longer reachable. File operations are in fileops.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import time

from services.sandbox import linux, wire
from services.sandbox.fileops import FileOps, OpError

READ_CHUNK = 65536


class Stream:
    """One output pipe of a command: forwards the head, keeps the tail."""

    def __init__(self, fd: int, kind: bytes, tail_kind: bytes, cap: int) -> None:
        self.fd = fd
        self.kind = kind
        self.tail_kind = tail_kind
        self.head_left = cap - cap // 2
        self.tail_cap = cap // 2
        self.tail = bytearray()
        self.truncated = False

    def feed(self, data: bytes) -> bytes:
        """Account for `data`; return the part to forward now."""
        if self.head_left > 0:
            now = data[: self.head_left]
            self.head_left -= len(now)
            data = data[len(now):]
        else:
            now = b""
        if data:
            self.truncated = True
            self.tail += data
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]
        return now


class Command:
    """A running exec and the connection that asked for it."""

    def __init__(self, conn: socket.socket, pid: int, out: Stream, err: Stream, stdin_fd: int | None,
                 stdin_data: bytes, deadline: float | None) -> None:
        self.conn = conn
        self.pid = pid
        self.out = out
        self.err = err
        self.stdin_fd = stdin_fd
        self.stdin_data = bytearray(stdin_data)
        self.stdin_open = False  # more input may come (envd SendInput) until CloseStdin
        self.deadline = deadline
        self.status: int | None = None
        self.timed_out = False
        self.cancelled = False
        self.detach = False  # keep running when the client goes away (envd semantics)
        self.argv: list[str] = []
        self.cwd = ""
        self.started = time.monotonic()
        # The exec-status pipe: EOF once the command is executed, "CODE ..." if that failed. Watched in the
        # select loop like the output, so that starting a command never waits for the exec.
        self.status_fd = -1
        self.failure = b""


def _read_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def read_frame(conn: socket.socket) -> tuple[bytes, bytes]:
    kind, length = wire.HEADER.unpack(_read_exact(conn, wire.HEADER.size))
    if length > wire.MAX_FRAME:
        raise ValueError("frame too large")
    return kind, _read_exact(conn, length)


def _proc_children() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def _descendants(root: int) -> set[int]:
    children = _proc_children()
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def kill_tree(root: int) -> None:
    """Stop every process of the tree under `root` (so none can fork away), then kill them all."""
    stopped: set[int] = set()
    for _ in range(100):
        tree = _descendants(root) | {root}
        new = tree - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= new
    try:
        os.killpg(root, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _no_inherited_fds() -> None:
    """Mark every descriptor above 2 close-on-exec: posix_spawn does not close the rest, exec does."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the listing's own descriptor, closed meanwhile


def _raise_oom_score() -> None:
    """Commands are the OOM killer's first choice in their sandbox, the init its last (raising a score
    needs no privilege, so this holds even where the init could not lower its own)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("300")
    except OSError:
        pass


def _failure_text(report: bytes, argv: list[str]) -> str:
    """The exec failure a child reported: "CODE ERRNO" from the helper, "CODE MESSAGE" from a forked child."""
    _, _, rest = report.decode(errors="replace").partition(" ")
    if rest.isdigit():
        return f"{argv[0]}: {os.strerror(int(rest))}"
    return rest


def _fork(argv: list[str], env: dict[str, str], cwd: str, stdin: int, stdout: int, stderr: int,
          status: int) -> int:
    """Start a command by forking the init (without the exec helper); the child reports a failed exec on `status`."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        _raise_oom_score()
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.closerange(3, status)
        os.closerange(status + 1, 65536)
        os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    except BaseException as e:  # noqa: BLE001 - report any failure to the parent, then die
        msg = f"{argv[0]}: {getattr(e, 'strerror', None) or e}"
        code = 127 if isinstance(e, (FileNotFoundError, NotADirectoryError)) else 126
        try:
            os.write(status, f"{code} {msg}".encode())
        finally:
            os._exit(code)
    os._exit(127)  # not reached: execvpe returns only by raising


class Init:
    """The control-socket server. `base` is "" when the root is pivoted (namespace backends),
    or the host directory standing in for "/" (process backend)."""

    def __init__(self, listener: socket.socket, home: str, base: str = "", helper_fd: int = -1) -> None:
        self.listener = listener
        self.home = home
        self.files = FileOps(home, base)
        self.commands: dict[int, Command] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        # The exec helper (exec_helper.py), opened before pivot_root; -1: commands start by fork.
        self.helper = f"/proc/self/fd/{helper_fd}" if helper_fd >= 0 else ""
        _no_inherited_fds()
        # Set up here, not in serve(): a blank sandbox's init (blank_pool.py) does it before it has a root,
        # so that its first request after the attach does not wait for it.
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        # Ignored signals stay ignored across exec: the helper's commands get them back at their default.
        self.default_signals = tuple(sig for sig in signal.valid_signals()
                                     if sig not in (signal.SIGKILL, signal.SIGSTOP)
                                     and signal.getsignal(sig) == signal.SIG_IGN)

    # ---- paths ----
    def op_signal(self, req: dict) -> dict:
        pid, sig = int(req.get("pid") or 0), int(req.get("signal") or signal.SIGKILL)
        cmd = self.commands.get(pid)
        if cmd is None or cmd.status is not None:
            raise OpError("not_found", f"no running command with pid {pid}")
        if sig == signal.SIGKILL:
            kill_tree(pid)
        else:
            os.killpg(pid, sig)
        return {"ok": True}

    def file_op(self, conn: socket.socket, req: dict) -> None:
        op = req.get("op")
        data = b""
        if req.get("data_len"):
            _, data = read_frame(conn)
        if op in ("signal", "stdin"):
            try:
                reply, out = (self.op_signal(req) if op == "signal" else self.op_stdin(req, data)), b""
            except OpError as e:
                reply, out = {"ok": False, "code": e.code, "message": e.message}, b""
        elif op == "processes":
            reply, out = {"ok": True, "processes": [
                {"pid": c.pid, "argv": c.argv, "cwd": c.cwd} for c in self.commands.values()
                if c.status is None]}, b""
        elif op == "ping":
            reply, out = {"ok": True, "pid": os.getpid(), "commands": len(self.commands)}, b""
        else:
            reply, out = self.files.run(op, req, data)
        reply["data_len"] = len(out)
        msg = wire.json_frame(wire.REPLY, reply)
        if out:
            msg += wire.frame(wire.DATA, out)
        conn.sendall(msg)


    def start_exec(self, conn: socket.socket, req: dict) -> None:
        stdin_data = b""
        if req.get("data_len"):
            _, stdin_data = read_frame(conn)
        argv = [str(a) for a in req.get("argv") or []]
        env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
        cwd = req.get("cwd") or self.home
        cap = max(2, int(req.get("cap") or 1 << 20))
        timeout = float(req.get("timeout") or 0)
        if not argv:
            conn.sendall(wire.json_frame(wire.EXIT, {"error": "empty argv"}))
            conn.close()
            return
        try:
            cwd_host = self.files.host(self.files.shown(cwd))
            if not os.path.isdir(cwd_host):
                raise OpError("invalid_argument", f"working directory {cwd!r} does not exist in the sandbox")
        except OpError as e:
            conn.sendall(wire.json_frame(wire.EXIT, {"error": e.message}))
            conn.close()
            return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        keep_stdin = bool(req.get("stdin_open"))
        in_r, in_w = os.pipe() if stdin_data or keep_stdin else (os.open("/dev/null", os.O_RDONLY), None)
        exec_r, exec_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = (self._spawn if self.helper else _fork)(argv, env, cwd_host, in_r, out_w, err_w, exec_w)
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, in_r, in_w, exec_r, exec_w):
                if fd is not None:
                    os.close(fd)
            raise
        os.close(out_w)
        os.close(err_w)
        os.close(in_r)
        os.close(exec_w)
        out = Stream(out_r, wire.STDOUT, wire.STDOUT_TAIL, cap)
        err = Stream(err_r, wire.STDERR, wire.STDERR_TAIL, cap)
        for fd in (out_r, err_r, exec_r):
            os.set_blocking(fd, False)
        if in_w is not None:
            os.set_blocking(in_w, False)
        cmd = Command(conn, pid, out, err, in_w, stdin_data,
                      time.monotonic() + timeout if timeout > 0 else None)
        cmd.detach = bool(req.get("detach"))
        cmd.stdin_open = keep_stdin
        cmd.argv, cmd.cwd = argv, cwd
        cmd.status_fd = exec_r
        self.commands[pid] = cmd
        if req.get("announce", True):  # the pid comes with the exit status too; a plain run skips this frame
            try:
                conn.sendall(wire.json_frame(wire.STARTED, {"pid": pid}))
            except OSError:
                self.cancel(cmd)

    def read_status(self, cmd: Command) -> None:
        """Collect what the exec-status pipe has (a failure report); close it at EOF."""
        while cmd.status_fd >= 0:
            try:
                data = os.read(cmd.status_fd, 4096)
            except BlockingIOError:
                return
            if not data:
                os.close(cmd.status_fd)
                cmd.status_fd = -1
                return
            cmd.failure += data

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str, stdin: int, stdout: int, stderr: int,
               status: int) -> int:
        """Start a command through the exec helper: posix_spawn makes the session, resets the signals and
        sets fds 0-3 (3: the status pipe); the helper becomes subreaper, raises the OOM score, chdirs, execs."""
        return os.posix_spawn(self.helper, ["rlyard-exec", cwd, *argv], env, setsid=True, setsigmask=(),
                              setsigdef=self.default_signals, file_actions=[
                                  (os.POSIX_SPAWN_DUP2, stdin, 0), (os.POSIX_SPAWN_DUP2, stdout, 1),
                                  (os.POSIX_SPAWN_DUP2, stderr, 2), (os.POSIX_SPAWN_DUP2, status, 3)])

    def cancel(self, cmd: Command) -> None:
        if not cmd.cancelled:
            cmd.cancelled = True
            if cmd.status is None and not cmd.detach:
                kill_tree(cmd.pid)

    def send(self, cmd: Command, data: bytes) -> None:
        if cmd.cancelled:
            return
        try:
            cmd.conn.sendall(data)
        except OSError:
            self.cancel(cmd)

    def pump(self, cmd: Command, stream: Stream) -> bool:
        """Read what is available; False at end of file."""
        while True:
            try:
                data = os.read(stream.fd, READ_CHUNK)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                os.close(stream.fd)
                stream.fd = -1
                return False
            now = stream.feed(data)
            if now:
                self.send(cmd, wire.frame(stream.kind, now))
            if len(data) < READ_CHUNK:
                return True

    def finish(self, cmd: Command) -> None:
        self.read_status(cmd)  # the command has ended: the pipe holds its whole report and is at EOF
        if cmd.status_fd >= 0:
            os.close(cmd.status_fd)
            cmd.status_fd = -1
        if cmd.failure:
            self.send(cmd, wire.frame(wire.STDERR, f"rlyard: cannot execute {_failure_text(cmd.failure, cmd.argv)}\n"
                                      .encode()))
        for stream in (cmd.out, cmd.err):
            if stream.fd >= 0:
                self.pump(cmd, stream)
                if stream.fd >= 0:
                    os.close(stream.fd)
                    stream.fd = -1
        if cmd.stdin_fd is not None:
            os.close(cmd.stdin_fd)
            cmd.stdin_fd = None
        status = cmd.status or 0
        if cmd.timed_out:
            code = 124
        elif os.WIFSIGNALED(status):
            code = 128 + os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status)
        msg = b""
        for stream in (cmd.out, cmd.err):
            if stream.truncated:
                msg += wire.frame(stream.tail_kind, bytes(stream.tail))
        msg += wire.json_frame(wire.EXIT, {
            "pid": cmd.pid, "exit_code": code, "timed_out": cmd.timed_out, "stdout_truncated": cmd.out.truncated,
            "stderr_truncated": cmd.err.truncated, "duration_ms": (time.monotonic() - cmd.started) * 1000})
        self.send(cmd, msg)
        try:
            cmd.conn.close()
        except OSError:
            pass
        del self.commands[cmd.pid]

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            cmd = self.commands.get(pid)
            if cmd is not None:
                cmd.status = status

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        conn.settimeout(30)
        try:
            kind, payload = read_frame(conn)
            req = json.loads(payload)
            if req.get("op") == "exec":
                self.start_exec(conn, req)
                return
            self.file_op(conn, req)
        except Exception as e:  # noqa: BLE001 - a bad request must never take init down
            try:
                conn.sendall(wire.json_frame(wire.REPLY, {"ok": False, "code": "internal", "message": str(e)}))
            except OSError:
                pass
        conn.close()

    def serve(self) -> None:
        self.listener.setblocking(False)
        while True:
            rlist = [self.listener, self.wake_r]
            wlist = []
            conns = {}
            deadline = None
            for cmd in self.commands.values():
                for stream in (cmd.out, cmd.err):
                    if stream.fd >= 0:
                        rlist.append(stream.fd)
                if cmd.status_fd >= 0:
                    rlist.append(cmd.status_fd)
                if not cmd.cancelled:
                    rlist.append(cmd.conn)
                    conns[cmd.conn] = cmd
                if cmd.stdin_fd is not None and cmd.stdin_data:
                    wlist.append(cmd.stdin_fd)
                if cmd.deadline is not None and cmd.status is None:
                    deadline = cmd.deadline if deadline is None else min(deadline, cmd.deadline)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                readable, writable, _ = select.select(rlist, wlist, [], timeout)
            except InterruptedError:
                continue
            if self.wake_r in readable:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            self.reap()
            if self.listener in readable:
                self.accept()
            by_fd = {}
            status_fds = {}
            for cmd in list(self.commands.values()):
                by_fd[cmd.out.fd] = (cmd, cmd.out)
                by_fd[cmd.err.fd] = (cmd, cmd.err)
                status_fds[cmd.status_fd] = cmd
            for fd in readable:
                if isinstance(fd, int) and fd in status_fds and fd >= 0:
                    self.read_status(status_fds[fd])
                elif isinstance(fd, int) and fd in by_fd:
                    cmd, stream = by_fd[fd]
                    self.pump(cmd, stream)
                elif fd in conns:
                    cmd = conns[fd]
                    try:
                        gone = not fd.recv(1, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        self.cancel(cmd)
            for fd in writable:
                for cmd in self.commands.values():
                    if cmd.stdin_fd == fd:
                        self.feed_stdin(cmd)
            now = time.monotonic()
            for cmd in list(self.commands.values()):
                if cmd.status is None and cmd.deadline is not None and now >= cmd.deadline:
                    cmd.timed_out = True
                    kill_tree(cmd.pid)
            self.reap()
            for cmd in list(self.commands.values()):
                if cmd.status is not None:
                    self.finish(cmd)

    def feed_stdin(self, cmd: Command) -> None:
        if cmd.stdin_fd is None:
            return
        try:
            n = os.write(cmd.stdin_fd, cmd.stdin_data[:READ_CHUNK])
            del cmd.stdin_data[:n]
        except BlockingIOError:
            return
        except OSError:
            cmd.stdin_data.clear()
            cmd.stdin_open = False
        if not cmd.stdin_data and not cmd.stdin_open:
            os.close(cmd.stdin_fd)
            cmd.stdin_fd = None

    def op_stdin(self, req: dict, data: bytes) -> dict:
        """More input for a running command started with stdin_open; `close` ends it once written."""
        pid = int(req.get("pid") or 0)
        cmd = self.commands.get(pid)
        if cmd is None or cmd.status is not None:
            raise OpError("not_found", f"no running command with pid {pid}")
        if cmd.stdin_fd is None:
            raise OpError("failed_precondition", f"the standard input of {pid} is closed (start the command "
                                                 "with stdin kept open)")
        if len(cmd.stdin_data) + len(data) > 64 << 20:
            raise OpError("resource_exhausted", "more than 64 MiB of input is waiting; let the command read it")
        cmd.stdin_data += data
        if req.get("close"):
            cmd.stdin_open = False
        self.feed_stdin(cmd)
        return {"ok": True}

