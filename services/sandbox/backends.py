"""Choosing the isolation backend: namespace (root), userns (rootless) or process (weak, last resort)."""
from __future__ import annotations

import logging
import os

from services.sandbox import linux

log = logging.getLogger(__name__)

NS_FLAGS = linux.NS_FLAGS
BACKENDS = ("namespace", "userns", "process")
PROCESS_WARNING = ("ISOLATION IS WEAK: the 'process' backend runs commands on the host filesystem, in the host's "
                   "network and pid namespaces, with only a private session, a sanitized environment and rlimits. "
                   "Do not run untrusted code with it; run the service as root (namespace backend) or allow "
                   "unprivileged user namespaces (userns backend).")


def _has_overlay() -> bool:
    try:
        with open("/proc/filesystems") as f:
            return any(line.split()[-1] == "overlay" for line in f if line.strip())
    except OSError:
        return False


def probe() -> dict[str, str | None]:
    """For each backend, None when usable here, else why not."""
    overlay = _has_overlay()
    why: dict[str, str | None] = {"process": None}
    if os.geteuid() != 0:
        why["namespace"] = "needs root"
    elif not overlay:
        why["namespace"] = "the kernel has no overlayfs"
    elif not linux.can_unshare(NS_FLAGS):
        why["namespace"] = "unshare(mount, pid, net, ipc, uts) is not permitted"
    else:
        why["namespace"] = None
    if not overlay:
        why["userns"] = "the kernel has no overlayfs"
    elif not linux.can_unshare(NS_FLAGS | linux.CLONE_NEWUSER):
        why["userns"] = "unprivileged user namespaces are disabled"
    else:
        why["userns"] = None
    return why


def choose(requested: str) -> str:
    """The backend to use; `requested` is "auto" or a backend name. Logs the choice and why."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {requested!r}; choose one of auto, {', '.join(BACKENDS)}")
    why = probe()
    if requested != "auto":
        if why[requested] is not None:
            raise RuntimeError(f"backend {requested!r} is not usable here: {why[requested]}")
        chosen = requested
        log.info("isolation backend: %s (configured)", chosen)
    else:
        chosen = next(b for b in BACKENDS if why[b] is None)
        skipped = "; ".join(f"{b}: {why[b]}" for b in BACKENDS[:BACKENDS.index(chosen)])
        log.info("isolation backend: %s (auto%s)", chosen, f"; skipped {skipped}" if skipped else "")
    if chosen == "process":
        log.warning(PROCESS_WARNING)
    return chosen
