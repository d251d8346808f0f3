"""Named root-filesystem templates: build with debootstrap, import a tarball or a directory, list.

A template is a directory `<home>/templates/<name>/rootfs` plus `meta.json`. It
becomes the read-only lower layer of every sandbox made from it, so a sandbox
never sees the host's filesystem. Building is idempotent: a finished template
(meta.json present) is reused, a half-built one is removed first.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "default"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# What RL tasks and the e2b SDK expect to find: a shell, coreutils, python3, git, ps.
DEFAULT_PACKAGES = ["bash", "coreutils", "python3", "git", "procps", "ca-certificates", "less",
                    "findutils", "grep", "sed", "gawk", "tar", "gzip", "xz-utils", "curl", "iproute2"]
BUILD_HINT = "python -m services.sandbox template build default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TemplateError(Exception):
    """A template cannot be built, imported or found; the message says what to do."""


@dataclass
class Template:
    """A ready template."""
    name: str
    rootfs: Path
    source: str
    size_bytes: int
    created_at: float


def default_home() -> Path:
    """`$RLYARD_HOME`, else ~/.cache/rlyard."""
    return Path(os.environ.get("RLYARD_HOME") or Path.home() / ".cache" / "rlyard")


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise TemplateError(f"bad template name {name!r}: use letters, digits, '.', '_' or '-' (max 64)")
    return name


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class TemplateStore:
    """Templates under `<home>/templates`."""

    def __init__(self, home: Path | None = None) -> None:
        self.root = (home or default_home()) / "templates"
        # name -> ((inode, mtime) of meta.json, Template): a create looks its template up without reading it
        self._cache: dict[str, tuple[tuple[int, int], Template]] = {}

    def _dir(self, name: str) -> Path:
        return self.root / check_name(name)

    def get(self, name: str) -> Template:
        """The ready template `name`, or TemplateError saying how to build it."""
        d = self._dir(name)
        meta = d / "meta.json"
        try:
            st = meta.stat()
            key = (st.st_ino, st.st_mtime_ns)
        except OSError:
            key = None
        if key is None or not meta.is_file():
            hint = BUILD_HINT if name == DEFAULT_TEMPLATE else (
                f"python -m services.sandbox template import {name} <rootfs.tar|dir>")
            raise TemplateError(f"template {name!r} is not built (looked in {d}); build it with: {hint}")
        cached = self._cache.get(name)
        if cached and cached[0] == key:
            return cached[1]
        info = json.loads(meta.read_text())
        t = Template(name, (d / "rootfs").resolve(), info.get("source", "?"), int(info.get("size_bytes", 0)),
                     float(info.get("created_at", 0)))
        self._cache[name] = (key, t)
        return t

    def exists(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except TemplateError:
            return False

    def list(self) -> list[Template]:
        if not self.root.is_dir():
            return []
        out = []
        for d in sorted(self.root.iterdir()):
            if (d / "meta.json").is_file():
                out.append(self.get(d.name))
        return out

    def _finish(self, name: str, source: str, staging: Path) -> Template:
        rootfs = staging / "rootfs"
        _prepare_rootfs(rootfs)
        size = _dir_size(rootfs)
        (staging / "meta.json").write_text(json.dumps(
            {"name": name, "source": source, "size_bytes": size, "created_at": time.time()}))
        final = self._dir(name)
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        log.info("template %r ready at %s (%s, %.1f MB)", name, final, source, size / 1e6)
        return self.get(name)

    def _staging(self, name: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{check_name(name)}.building"
        if staging.exists():
            shutil.rmtree(staging)
        (staging / "rootfs").mkdir(parents=True)
        return staging

    def build(self, name: str = DEFAULT_TEMPLATE, *, suite: str = DEFAULT_SUITE, mirror: str = DEFAULT_MIRROR,
              packages: list[str] | None = None, force: bool = False) -> Template:
        """Build `name` with `debootstrap --variant=minbase`; a no-op when it already exists."""
        if not force and self.exists(name):
            log.info("template %r already built at %s", name, self._dir(name))
            return self.get(name)
        debootstrap = shutil.which("debootstrap") or (
            "/usr/sbin/debootstrap" if os.path.exists("/usr/sbin/debootstrap") else None)
        if debootstrap is None:
            raise TemplateError("debootstrap is not installed; install it with: apt-get install -y debootstrap "
                                "(or import a rootfs: python -m services.sandbox template import NAME rootfs.tar)")
        if os.geteuid() != 0:
            raise TemplateError("building a template with debootstrap needs root; run it as root or import a "
                                "rootfs tarball: python -m services.sandbox template import NAME rootfs.tar")
        staging = self._staging(name)
        pkgs = ",".join(packages or DEFAULT_PACKAGES)
        cmd = [debootstrap, "--variant=minbase", f"--include={pkgs}", suite, str(staging / "rootfs"), mirror]
        log.info("building template %r: %s", name, " ".join(cmd))
        t0 = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-15:])
            shutil.rmtree(staging, ignore_errors=True)
            raise TemplateError(f"debootstrap failed (exit {proc.returncode}):\n{tail}")
        # apt caches are not needed inside sandboxes.
        shutil.rmtree(staging / "rootfs" / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        log.info("debootstrap took %.0f s", time.time() - t0)
        return self._finish(name, "debootstrap", staging)

    def import_path(self, name: str, src: str | Path, *, force: bool = False) -> Template:
        """Import a rootfs from a tarball (e.g. `docker export` output, gz/xz ok) or a directory."""
        src = Path(src)
        if self.exists(name) and not force:
            raise TemplateError(f"template {name!r} exists; pass --force to replace it")
        if not src.exists():
            raise TemplateError(f"{src} does not exist")
        staging = self._staging(name)
        rootfs = staging / "rootfs"
        try:
            if src.is_dir():
                subprocess.run(["cp", "-a", "--", f"{src}/.", str(rootfs)], check=True)
                source = "directory"
            else:
                with tarfile.open(src) as tar:
                    tar.extractall(rootfs, filter="fully_trusted" if os.geteuid() == 0 else "tar")
                source = "tar"
        except (OSError, tarfile.TarError, subprocess.CalledProcessError) as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise TemplateError(f"cannot import {src}: {e}") from e
        if not (rootfs / "bin" / "sh").exists() and not (rootfs / "usr" / "bin" / "sh").exists():
            shutil.rmtree(staging, ignore_errors=True)
            raise TemplateError(f"{src} does not look like a root filesystem (no /bin/sh)")
        return self._finish(name, source, staging)

    def remove(self, name: str) -> None:
        d = self._dir(name)
        if not d.exists():
            raise TemplateError(f"template {name!r} does not exist")
        shutil.rmtree(d)


def _prepare_rootfs(rootfs: Path) -> None:
    """Mount points and files every sandbox expects, made once in the template."""
    for sub in ("proc", "dev", "tmp", "root", "sys", "run", "home/user", "etc"):
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    (rootfs / "etc" / "hostname").write_text("sandbox\n")
    (rootfs / "etc" / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    resolv = rootfs / "etc" / "resolv.conf"
    if resolv.is_symlink() or not resolv.exists():
        resolv.unlink(missing_ok=True)
        resolv.write_text("")
