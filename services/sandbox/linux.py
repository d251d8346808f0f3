"""Thin ctypes wrappers for the Linux calls Python 3.11 lacks: unshare, mount, pivot_root, prctl, capabilities.

Standard library only: the sandbox's zygote and init import this module with
`python -S`, and the init keeps using it after `pivot_root`.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

def _load_libc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        # ctypes.util pulls in tempfile and random (whose fork hook reseeds in every child): only as a fallback.
        from ctypes import util
        return ctypes.CDLL(util.find_library("c"), use_errno=True)


_libc = _load_libc()

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# The namespaces every sandbox gets (plus CLONE_NEWUSER for the userns backend).
NS_FLAGS = (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_MOVE = 8192
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

SYS_PIVOT_ROOT = 155  # x86_64
SYS_CAPSET = 126      # x86_64
CAP_LAST = 40

# Capabilities a sandboxed command keeps: Docker's default set without CAP_MKNOD (there is no devices
# cgroup here, so a device node made inside could reach host disks). Everything else, CAP_SYS_ADMIN,
# CAP_SYS_PTRACE, CAP_SYS_MODULE, CAP_NET_ADMIN, CAP_MKNOD ..., is dropped.
KEEP_CAPS = (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 29, 31)

for _fn in ("unshare", "mount", "umount2", "prctl", "sethostname", "syscall"):
    getattr(_libc, _fn).restype = ctypes.c_int
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _b(s: str | bytes | None) -> bytes | None:
    if s is None or isinstance(s, bytes):
        return s
    return s.encode()


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {fstype or ''} {target}")


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                              ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)), "prctl")


def set_process_name(name: str) -> None:
    """Set this process's name as `ps -o comm` shows it (15 bytes at most)."""
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _check(_libc.prctl(15, ctypes.c_ulong(ctypes.addressof(buf)), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), "prctl(PR_SET_NAME)")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")


def drop_bounding(keep: tuple[int, ...] = KEEP_CAPS) -> None:
    """Shrink the capability bounding set to `keep`: no later exec can gain more. The capabilities this
    process has now stay effective until drop_capabilities."""
    for cap in range(CAP_LAST + 1):
        if cap not in keep:
            try:
                prctl(PR_CAPBSET_DROP, cap)
            except OSError:
                pass  # unknown to this kernel


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities(keep: tuple[int, ...] = KEEP_CAPS, bounding: bool = True) -> None:
    """Shrink the bounding set (unless `bounding` is False: done already) and the effective/permitted sets
    to `keep`."""
    if bounding:
        drop_bounding(keep)
    mask = 0
    for cap in keep:
        mask |= 1 << cap
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = mask & 0xFFFFFFFF
    data[1].effective = data[1].permitted = mask >> 32
    _check(_libc.syscall(SYS_CAPSET, ctypes.byref(hdr), ctypes.byref(data)), "capset")


def loopback_up() -> None:
    """Bring `lo` up in the current network namespace."""
    siocgifflags, siocsifflags = 0x8913, 0x8914
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, siocgifflags, req))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | 0x1 | 0x40, b""))


def can_unshare(flags: int) -> bool:
    """Whether this process may create these namespaces (tested in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        try:
            unshare(flags)
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
