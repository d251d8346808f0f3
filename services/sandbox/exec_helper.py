"""The exec helper: a tiny static program through which a sandbox's init starts every command.

Forking the init (a Python process) costs ~2 ms per command: the fork copies its
page tables and then both sides take copy-on-write faults while the child runs
Python code up to execve. Instead the init calls posix_spawn (a vfork-like clone:
no copy, whatever the init's size; it also makes the new session, resets the
signals and sets fds 0-3) on this helper, which does the rest of the command's
set-up the Python child did (child subreaper, OOM score, working directory) and
executes the command in the same process. Same isolation, one extra small exec.

The C source below is compiled once per host with the system's C compiler into
`<state dir>/bin/rlyard-exec-<hash>` (or given prebuilt with `--exec-helper PATH`).
Without a compiler the init falls back to fork, logged once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = r'''/* rlyard-exec: the last step of starting a command in a sandbox, run by the init through posix_spawn.
 *
 *   rlyard-exec CWD PROGRAM [ARG...]      (fd 3: the init's exec-status pipe)
 *
 * posix_spawn (vfork-like, cheap whatever the init's size) has already made the new session, reset the
 * signals and set up fds 0-3. What it cannot do is done here, then PROGRAM is executed (searched in the
 * PATH of the environment, like execvp): become a child subreaper (orphans of the command stay in its
 * tree, so a timeout kills them too), raise the OOM score (the command dies before the init), chdir.
 * On failure it writes "CODE ERRNO" to fd 3 and exits with CODE (127: not found, 126: not executable).
 * Without libc on x86_64 (a static glibc start-up costs more than the rest of this program).
 */
#include <asm/unistd.h>

#define PR_SET_CHILD_SUBREAPER 36
#define F_SETFD 2
#define FD_CLOEXEC 1
#define O_WRONLY 01
#define O_CLOEXEC 02000000
#define ENOENT 2
#define ENOTDIR 20
#define EACCES 13
#define PATH_CAP 4096

#if defined(__x86_64__) && !defined(RLYARD_USE_LIBC)
static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}
static long sys5(long n, long a, long b, long c, long d, long e) {
    long r;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8) : "rcx", "r11", "memory");
    return r;
}
#define NO_LIBC 1
#else
#include <errno.h>
#include <unistd.h>
extern long syscall(long, ...);
static long sys3(long n, long a, long b, long c) { long r = syscall(n, a, b, c); return r < 0 ? -errno : r; }
static long sys5(long n, long a, long b, long c, long d, long e) {
    long r = syscall(n, a, b, c, d, e); return r < 0 ? -errno : r;
}
#endif

static void fail(long err) {
    int code = (err == ENOENT || err == ENOTDIR) ? 127 : 126;
    char buf[16];
    int n = 0;
    buf[n++] = '0' + code / 100; buf[n++] = '0' + code / 10 % 10; buf[n++] = '0' + code % 10; buf[n++] = ' ';
    char digits[8]; int d = 0;
    do { digits[d++] = '0' + err % 10; err /= 10; } while (err && d < 8);
    while (d) buf[n++] = digits[--d];
    sys3(__NR_write, 3, (long)buf, n);
    sys3(__NR_exit_group, code, 0, 0);
}

static const char *find_path(char **envp) {
    for (; *envp; envp++) {
        const char *e = *envp;
        if (e[0] == 'P' && e[1] == 'A' && e[2] == 'T' && e[3] == 'H' && e[4] == '=') return e + 5;
    }
    return "/usr/local/bin:/usr/bin:/bin";
}

static int has_slash(const char *s) { for (; *s; s++) if (*s == '/') return 1; return 0; }

static int run(int argc, char **argv, char **envp) {
    if (argc < 3) fail(22);
    sys5(__NR_prctl, PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    long fd = sys3(__NR_open, (long)"/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC, 0);
    if (fd >= 0) { sys3(__NR_write, fd, (long)"300", 3); sys3(__NR_close, fd, 0, 0); }
    sys3(__NR_fcntl, 3, F_SETFD, FD_CLOEXEC);
    long r = sys3(__NR_chdir, (long)argv[1], 0, 0);
    if (r < 0) fail(-r);
    const char *prog = argv[2];
    if (has_slash(prog)) fail(-sys3(__NR_execve, (long)prog, (long)(argv + 2), (long)envp));
    /* execvp's search: the first entry that executes wins; EACCES is remembered, other errors skipped. */
    char buf[PATH_CAP];
    long err = ENOENT;
    int seen_eacces = 0;
    const char *p = find_path(envp);
    for (;;) {
        const char *end = p;
        while (*end && *end != ':') end++;
        int n = 0;
        for (const char *q = p; q < end && n < PATH_CAP - 2; q++) buf[n++] = *q;
        if (n == 0) buf[n++] = '.';
        buf[n++] = '/';
        const char *q = prog;
        while (*q && n < PATH_CAP - 1) buf[n++] = *q++;
        buf[n] = 0;
        if (!*q) {
            r = -sys3(__NR_execve, (long)buf, (long)(argv + 2), (long)envp);
            if (r == EACCES) seen_eacces = 1;
            else if (r != ENOENT && r != ENOTDIR) err = r;
        }
        if (!*end) break;
        p = end + 1;
    }
    fail(seen_eacces ? EACCES : err);
    return 0;
}

#ifdef NO_LIBC
__attribute__((used)) void rlyard_start(long *sp) {
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1);
    run(argc, argv, argv + argc + 1);
}
__asm__(".global _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n call rlyard_start\n hlt\n");
#else
extern char **environ;
int main(int argc, char **argv) { return run(argc, argv, environ); }
#endif
'''


def _compile_command(cc: str, src: Path, out: Path) -> list[str]:
    if platform.machine() in ("x86_64", "AMD64"):
        return [cc, "-O2", "-static", "-nostdlib", "-fno-stack-protector", "-fno-builtin", "-o", str(out), str(src)]
    return [cc, "-O2", "-static", "-DRLYARD_USE_LIBC", "-o", str(out), str(src)]


def works(path: str | os.PathLike) -> bool:
    """True when `path` runs a command (`true` in /) and reports a missing one the agreed way (on fd 3)."""
    try:
        ok = subprocess.run([str(path), "/", "true"], timeout=10, stdin=subprocess.DEVNULL,
                            capture_output=True).returncode == 0
        missing = subprocess.run(["/bin/sh", "-c", 'exec "$0" / rlyard-no-such-program 3>&1', str(path)],
                                 timeout=10, stdin=subprocess.DEVNULL, capture_output=True)
        return ok and missing.returncode == 127 and missing.stdout == b"127 2"
    except (OSError, subprocess.SubprocessError):
        return False


def build(bin_dir: Path) -> Path | None:
    """Compile the helper into `bin_dir` (cached by source hash); None when there is no working C compiler."""
    digest = hashlib.sha256((SOURCE + platform.machine()).encode()).hexdigest()[:12]
    out = bin_dir / f"rlyard-exec-{digest}"
    if out.exists() and works(out):
        return out
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=bin_dir) as tmp:
        src, tmp_out = Path(tmp) / "rlyard-exec.c", Path(tmp) / "rlyard-exec"
        src.write_text(SOURCE)
        res = subprocess.run(_compile_command(cc, src, tmp_out), capture_output=True, text=True, timeout=120)
        if res.returncode != 0 or not works(tmp_out):
            log.warning("building the exec helper with %s failed: %s", cc, (res.stderr or "it does not run").strip())
            return None
        os.chmod(tmp_out, 0o755)
        os.replace(tmp_out, out)  # atomic: a concurrent build of the same source yields the same file
    return out


def resolve(setting: str, bin_dir: Path) -> str:
    """The helper's path for `setting` ("auto": build or reuse one; "off": none; else a prebuilt path);
    "" means commands are started by forking the init."""
    if setting == "off":
        log.info("exec helper off: commands start by forking the sandbox's init (~2 ms slower per command)")
        return ""
    if setting != "auto":
        if not works(setting):
            raise ValueError(f"exec helper {setting!r} does not run; build one with "
                             "`python -m services.sandbox.exec_helper DIR` or use --exec-helper auto")
        return str(Path(setting).resolve())
    path = build(bin_dir)
    if path is None:
        log.warning("no C compiler (cc) to build the exec helper: commands start by forking the sandbox's init "
                    "(~2 ms slower per command); install gcc and libc6-dev, or pass --exec-helper PATH")
        return ""
    log.info("exec helper %s: commands start through posix_spawn", path)
    return str(path)


if __name__ == "__main__":
    import sys

    built = build(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    if built is None:
        sys.exit("could not build the exec helper (is a C compiler with static libc installed?)")
    print(built)
