"""The exec helper (posix_spawn + a tiny static program) and the fork fallback start commands alike."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.grpc_server import channel
from services.common.proto.rlyard.v1 import sandbox_pb2 as pb
from services.common.proto.rlyard.v1 import sandbox_pb2_grpc
from services.sandbox import exec_helper
from tests.sandbox.conftest import serve, sh

@pytest.fixture(scope="module")
def helper(tmp_path_factory) -> str:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the exec helper")
    built = exec_helper.build(tmp_path_factory.mktemp("helper"))
    assert built is not None
    return str(built)


def test_build_is_cached_and_checked(helper, tmp_path):
    assert exec_helper.works(helper)
    again = exec_helper.build(Path(helper).parent)
    assert str(again) == helper  # same source: the cached binary, not a rebuild
    assert not exec_helper.works("/bin/true")  # does not report a missing program on fd 3
    assert exec_helper.resolve("off", tmp_path) == ""
    with pytest.raises(ValueError) as e:
        exec_helper.resolve("/bin/true", tmp_path)
    assert "--exec-helper" in str(e.value)


def test_helper_sets_up_the_command(helper, tmp_path):
    """Runs PROGRAM in CWD (found in the environment's PATH) as a child subreaper with a raised OOM score."""
    probe = ("import ctypes, os; v = ctypes.c_int(); ctypes.CDLL(None).prctl(37, ctypes.byref(v), 0, 0, 0); "
             "print(os.getcwd(), v.value, open('/proc/self/oom_score_adj').read().strip())")
    env = {"PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"}
    out = subprocess.run([helper, str(tmp_path), os.path.basename(sys.executable), "-c", probe], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    cwd, subreaper, oom = out.stdout.split()
    assert (cwd, subreaper) == (str(tmp_path), "1") and int(oom) >= 300


@pytest.mark.parametrize("argv, code, errno", [
    (["/", "no-such-program"], 127, 2),        # not in PATH
    (["/no/such/dir", "true"], 127, 2),        # bad working directory
    (["/", "{plain}"], 126, 13),               # not executable
    (["/", "{script}"], 126, 8),               # no #! line: not run through a shell (as os.execvpe)
])
def test_helper_reports_failures_on_fd_3(helper, tmp_path, argv, code, errno):
    (tmp_path / "plain").write_text("data")
    (tmp_path / "script").write_text("echo hi")
    (tmp_path / "script").chmod(0o755)
    argv = [a.format(plain=tmp_path / "plain", script=tmp_path / "script") for a in argv]
    out = subprocess.run(["/bin/sh", "-c", 'exec "$0" "$@" 3>&1', helper, *argv], capture_output=True, timeout=30)
    assert out.returncode == code and out.stdout == f"{code} {errno}".encode()


@pytest.fixture(scope="module")
def forking_service(tmp_path_factory):
    """A service whose inits start commands by fork (no exec helper)."""
    yield from serve(tmp_path_factory, "sbfork", "--on-exit", "kill", "--exec-helper", "off", "--pool-size", "1")


async def _command_semantics(stub, sid: str) -> None:
    """What every command start must give: cwd, env, stdin, exit codes, only fds 0-2, OOM score, tree kill."""
    r = await stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["/bin/sh", "-c", "pwd; echo $FOO; cat"], cwd="/tmp",
                                       env={"FOO": "bar"}, stdin=b"in"))
    assert r.stdout == b"/tmp\nbar\nin"
    r = await stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["no-such-program"]))
    assert r.exit_code == 127 and b"no-such-program: No such file or directory" in r.stderr
    r = await stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["/etc/fstab"]))
    assert r.exit_code == 126 and b"Permission denied" in r.stderr
    r = await stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["python3", "-c", "import os; print(sorted(os.listdir("
                                       "'/proc/self/fd'), key=int)[:-1], os.getsid(0) == os.getpid())"]))
    assert r.stdout == b"['0', '1', '2'] True\n"  # the listing's own fd aside; own session
    r = await sh(stub, sid, "cat /proc/self/oom_score_adj; trap -p INT; kill -INT $$; echo survived")
    assert r.stdout.split(b"\n")[0] == b"300" and r.exit_code == 128 + 2  # SIGINT is not left ignored
    r = await sh(stub, sid, "(setsid sleep 4101 &); (sleep 4102 & disown); sleep 4103", timeout_s=0.5)
    assert r.timed_out and r.exit_code == 124
    r = await sh(stub, sid, "pgrep -x sleep || echo none")
    assert r.stdout == b"none\n"


async def test_commands_through_the_helper(stub, box, service):
    assert "commands start through posix_spawn" in service.log.read_text()
    await _command_semantics(stub, box)


async def test_commands_by_fork(forking_service):
    assert "exec helper off" in forking_service.log.read_text()
    async with channel(forking_service.target) as ch:
        stub = sandbox_pb2_grpc.SandboxStub(ch)
        info = await stub.Create(pb.CreateSandboxRequest())
        try:
            await _command_semantics(stub, info.sandbox_id)
        finally:
            await stub.Kill(pb.SandboxRef(sandbox_id=info.sandbox_id))


async def test_bad_helper_stops_the_start_cleanly(tmp_path):
    from services.sandbox.config import SandboxConfig
    from services.sandbox.manager import Manager

    m = Manager(SandboxConfig(home=tmp_path, backend="process", pool_size=0, exec_helper="/bin/true"))
    with pytest.raises(RuntimeError) as e:
        await m.start()
    assert "--exec-helper" in str(e.value)
    assert str(tmp_path) not in open("/proc/self/mounts").read()  # nothing mounted before the check
