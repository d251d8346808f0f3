"""On-disk layout of sandboxes, sealed layers and snapshots.

    <home>/sandbox/boxes/<id>/        state.json, root/ (mount point), rw/ (writable layer)
    /run/rlyard-<uid>-<tag>/<id>.sock the control socket of the sandbox's init (short path for AF_UNIX)
    <home>/sandbox/layers/<lid>/      a sealed, read-only copy of some sandbox's writable layer
    <home>/sandbox/snapshots/<sid>/   meta.json (+ the layer chain it needs)

As root, `rw/` is a tmpfs of `disk_mb` MiB holding the overlay's `upper/` and
`work/`: that size is the sandbox's disk quota. A filesystem snapshot or a fork
copies `upper/` once into a sealed layer that becomes a shared read-only lower
layer of every sandbox started from it (copy-on-write through overlayfs).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from services.sandbox import linux

log = logging.getLogger(__name__)

# Between two tmpfs mounts cp falls back to read/write with a fresh buffer per file; keeping malloc from
# mapping and trimming that buffer each time makes copying many small files ~15% faster.
_CP_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C",
           "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304:glibc.malloc.trim_threshold=67108864"}


class Storage:
    def __init__(self, state_dir: Path, use_tmpfs: bool, tag: str) -> None:
        self.boxes = state_dir / "boxes"
        self.layers = state_dir / "layers"
        self.fork_layers = state_dir / "fork-layers"
        self.snapshots = state_dir / "snapshots"
        # Control sockets live under a short path: AF_UNIX addresses are limited to 107 bytes.
        run = Path("/run") if os.geteuid() == 0 and os.access("/run", os.W_OK) else Path("/tmp")
        self.sockets = run / f"rlyard-{os.geteuid()}-{tag}"
        for d in (self.boxes, self.layers, self.fork_layers, self.snapshots, self.sockets):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sockets, 0o700)
        self.use_tmpfs = use_tmpfs
        # Mounted now, before any sandbox's mount namespace is copied from the host's: a blank sandbox
        # (blank_pool.py) must see the fork layers that are made after it started.
        self._mount_fork_layers()

    def _mount_fork_layers(self) -> None:
        """Fork layers live in memory, like the writable layers they are copied from: sealing is then a
        memory-to-memory copy. Snapshot layers go to disk, to outlive the service."""
        if self.use_tmpfs and not os.path.ismount(self.fork_layers):
            linux.mount("tmpfs", str(self.fork_layers), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=700,size=50%")

    def unmount_fork_layers(self) -> None:
        if os.path.ismount(self.fork_layers) and not any(self.fork_layers.iterdir()):
            linux.umount2(str(self.fork_layers), linux.MNT_DETACH)

    def box(self, sid: str) -> Path:
        return self.boxes / sid

    def prepare(self, sid: str, disk_mb: int) -> dict[str, str]:
        """Make the sandbox's directories (and its quota'd tmpfs); return the paths the zygote needs."""
        d = self.box(sid)
        (d / "root").mkdir(parents=True)
        rw = d / "rw"
        rw.mkdir()
        if self.use_tmpfs:
            linux.mount("tmpfs", str(rw), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"mode=700,size={disk_mb}m")
        (rw / "upper").mkdir()
        (rw / "work").mkdir()
        return {"root": str(d / "root"), "upper": str(rw / "upper"), "work": str(rw / "work"),
                "sock": str(self.sockets / f"{sid}.sock"), "base": str(rw / "upper")}

    def make_stage(self, sid: str) -> str:
        """Mount points where a blank sandbox's init mounts /proc, /dev and /tmp before it has a root."""
        stage = self.box(sid) / "stage"
        for name in ("proc", "dev", "tmp"):
            (stage / name).mkdir(parents=True, exist_ok=True)
        return str(stage)

    def resize(self, sid: str, disk_mb: int) -> None:
        """Change the quota of a sandbox's writable layer."""
        if self.use_tmpfs:
            linux.mount(None, str(self.box(sid) / "rw"), None, linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NODEV,
                        f"size={disk_mb}m")

    def release(self, sid: str) -> None:
        """Unmount and delete a sandbox's directories (idempotent)."""
        d = self.box(sid)
        for mnt in (d / "root", d / "rw"):
            if os.path.ismount(mnt):
                try:
                    linux.umount2(str(mnt), linux.MNT_DETACH)
                except OSError as e:
                    log.warning("umount %s: %s", mnt, e)
        shutil.rmtree(d, ignore_errors=True)
        try:
            (self.sockets / f"{sid}.sock").unlink()
        except FileNotFoundError:
            pass
        shutil.rmtree(self.sockets / f"{sid}.egress", ignore_errors=True)

    def remove_socket_dir(self) -> None:
        try:
            self.sockets.rmdir()
        except OSError:
            pass

    def upper(self, sid: str) -> Path:
        return self.box(sid) / "rw" / "upper"

    def write_state(self, sid: str, state: dict) -> None:
        p = self.box(sid) / "state.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, p)

    def read_states(self) -> dict[str, dict | None]:
        out: dict[str, dict | None] = {}
        for d in self.boxes.iterdir():
            try:
                out[d.name] = json.loads((d / "state.json").read_text())
            except (OSError, ValueError):
                out[d.name] = None
        return out

    async def seal(self, sid: str, in_memory: bool = False) -> str:
        """Copy the sandbox's writable layer into a new sealed layer; returns its path."""
        lid = uuid.uuid4().hex[:16]
        if in_memory:
            self._mount_fork_layers()
        dst = (self.fork_layers if in_memory else self.layers) / lid
        src = self.upper(sid)
        proc = await asyncio.create_subprocess_exec(
            "cp", "-a", "--reflink=auto", "--", str(src), str(dst),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_CP_ENV)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            shutil.rmtree(dst, ignore_errors=True)
            raise OSError(f"copying the writable layer failed: {err.decode(errors='replace').strip()}")
        return str(dst)

    def layer_paths(self) -> set[str]:
        return {str(d) for store in (self.layers, self.fork_layers) for d in store.iterdir()}

    def drop_layer(self, path: str) -> None:
        p = Path(path)
        if p.parent in (self.layers, self.fork_layers):
            shutil.rmtree(p, ignore_errors=True)

    def save_snapshot(self, snap_id: str, meta: dict) -> None:
        d = self.snapshots / snap_id
        d.mkdir(parents=True, exist_ok=True)
        (d / "meta.json").write_text(json.dumps(meta))

    def load_snapshot(self, snap_id: str) -> dict | None:
        if not snap_id or "/" in snap_id or snap_id.startswith("."):
            return None
        try:
            return json.loads((self.snapshots / snap_id / "meta.json").read_text())
        except (OSError, ValueError):
            return None

    def list_snapshots(self) -> list[dict]:
        out = []
        for d in self.snapshots.iterdir():
            meta = self.load_snapshot(d.name)
            if meta:
                out.append(meta)
        return out

    def delete_snapshot(self, snap_id: str) -> None:
        shutil.rmtree(self.snapshots / snap_id, ignore_errors=True)
