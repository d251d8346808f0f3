"""Settings of the sandbox service, with their defaults; every field is a CLI flag."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox.templates import DEFAULT_TEMPLATE, default_home


@dataclass
class SandboxConfig:
    """Service-wide settings. Resource values are defaults a Create request may override."""
    home: Path = field(default_factory=default_home)
    backend: str = "auto"            # auto | namespace | userns | process
    default_template: str = DEFAULT_TEMPLATE
    max_sandboxes: int = 1000
    timeout_s: int = 300             # default time to live
    max_timeout_s: int = 24 * 3600
    exec_timeout_s: float = 60.0     # default per-command timeout
    max_exec_timeout_s: float = 3600.0
    output_cap: int = 1 << 20        # default per-stream output cap (bytes)
    max_output_cap: int = 64 << 20
    memory_mb: int = 1024
    pids: int = 512
    cpu_millis: int = 1000
    disk_mb: int = 1024
    tmp_mb: int = 256
    home_dir: str = "/root"          # working directory of commands inside the sandbox
    # Extra variables every sandbox sees; nothing from the service's own environment is passed otherwise.
    env: dict[str, str] = field(default_factory=dict)
    api_keys: list[str] = field(default_factory=list)  # empty: the HTTP API accepts any key
    paused_ttl_s: int = 7 * 24 * 3600
    pool_size: int = 4               # warm sandboxes of the default template kept ready for create()
    blank_pool: int = 16             # blank sandboxes (all but the root) kept for cold creates and fork children
    exec_helper: str = "auto"        # auto (build with cc) | off (fork the init) | path of a prebuilt helper

    @property
    def state_dir(self) -> Path:
        return self.home / "sandbox"
