"""A seccomp filter for sandboxed processes, built as classic BPF through ctypes.

It refuses (EPERM) what a sandbox never needs and what widens the kernel's
attack surface: creating user namespaces (unshare/clone with CLONE_NEWUSER),
the kernel keyring, bpf, perf events, userfaultfd, module and kexec loading,
open_by_handle_at and setns; clone3 answers ENOSYS so that libc falls back
to clone, whose flags the filter can see. Foreign-architecture and x32
system calls are refused too. Standard library only.
"""
from __future__ import annotations

import ctypes
import errno

from services.sandbox import linux

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
NR_CLONE, NR_UNSHARE, NR_CLONE3 = 56, 272, 435
DENIED = {  # x86_64 numbers
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "init_module": 175,
    "delete_module": 176, "perf_event_open": 298, "open_by_handle_at": 304, "setns": 308,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
}
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def program() -> list[tuple[int, int | str, int | str, int]]:
    """The filter as (code, jump-if-true, jump-if-false, k); jumps name labels or are 0 (next)."""
    p: list = [("arch",), (LD_ABS_W, 0, 0, 4), (JEQ, 0, "deny", AUDIT_ARCH_X86_64),
               (LD_ABS_W, 0, 0, 0), (JGE, "deny", 0, X32_BIT)]
    p += [(JEQ, "deny", 0, nr) for nr in sorted(DENIED.values())]
    p += [(JEQ, "enosys", 0, NR_CLONE3), (JEQ, "flags", 0, NR_UNSHARE), (JEQ, "flags", "allow", NR_CLONE),
          ("flags",), (LD_ABS_W, 0, 0, 16), (JSET, "deny", "allow", linux.CLONE_NEWUSER),
          ("allow",), (RET, 0, 0, RET_ALLOW),
          ("deny",), (RET, 0, 0, RET_ERRNO | errno.EPERM),
          ("enosys",), (RET, 0, 0, RET_ERRNO | errno.ENOSYS)]
    labels, out = {}, []
    for item in p:
        if len(item) == 1:
            labels[item[0]] = len(out)
        else:
            out.append(item)
    resolved = []
    for i, (code, jt, jf, k) in enumerate(out):
        def off(target: int | str) -> int:
            return labels[target] - (i + 1) if isinstance(target, str) else target
        resolved.append((code, off(jt), off(jf), k))
    return resolved


def _compiled() -> tuple[ctypes.Array, _Prog]:
    insns = program()
    arr = (_Insn * len(insns))(*[_Insn(c, jt, jf, k) for c, jt, jf, k in insns])
    return arr, _Prog(len(insns), ctypes.cast(arr, ctypes.POINTER(_Insn)))


# Built once when the zygote imports this module; every init inherits it instead of building its own.
_FILTER = _compiled()


def install() -> None:
    """Install the filter on this process (inherited by every child). Needs no_new_privs or CAP_SYS_ADMIN."""
    linux.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(_FILTER[1]))
