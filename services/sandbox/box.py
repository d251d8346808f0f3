"""A sandbox's record: lifecycle states, resources, and the persisted fields the manager tracks."""
from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field

from services.sandbox.errors import SandboxError

CREATING, RUNNING, PAUSING, PAUSED, RESUMING = "creating", "running", "pausing", "paused", "resuming"
SNAPSHOTTING, FORKING, KILLING, KILLED = "snapshotting", "forking", "killing", "killed"
LIVE = (CREATING, RUNNING, PAUSING, PAUSED, RESUMING, SNAPSHOTTING, FORKING)
SNAPSHOT_KIND = "filesystem"
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Resources:
    memory_mb: int
    pids: int
    cpu_millis: int
    disk_mb: int


@dataclass
class Box:
    """One sandbox as the manager tracks it (persisted to state.json, minus the lock)."""
    id: str
    template: str
    backend: str
    resources: Resources
    lowers: list[str]
    created_at: float
    expires_at: float
    auto_pause: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    parent_id: str = ""
    state: str = CREATING
    pid: int = 0
    pid_start: int = 0
    sock: str = ""
    base: str = ""
    envd_token: str = ""
    snapshot_kind: str = SNAPSHOT_KIND
    killed_reason: str = ""
    ended_at: float = 0.0
    network: dict | None = None  # egress policy (egress.Policy fields); None = loopback only

    def __post_init__(self) -> None:
        self.lock = asyncio.Lock()
        self.pidfd = -1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Box":
        d = dict(d)
        d["resources"] = Resources(**d["resources"])
        return cls(**d)


def clean_env(env: dict[str, str] | None, what: str) -> dict[str, str]:
    """Validated environment variables; `what` names them in the error."""
    out = {}
    for k, v in (env or {}).items():
        if not _ENV_KEY.match(k):
            raise SandboxError("invalid_argument", f"{what}: bad environment variable name {k!r}")
        if "\x00" in v:
            raise SandboxError("invalid_argument", f"{what}: value of {k} contains a NUL byte")
        out[k] = v
    return out
