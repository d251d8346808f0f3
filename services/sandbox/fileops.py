"""File operations inside a sandbox, run by its init: read, write, list, stat, remove, mkdir, rename, tar.

Paths are as the sandbox sees them: absolute, or relative to the home
directory; any `..` component is rejected. In the namespace backends the
init is pivoted into the sandbox's root, so symlinks resolve inside it. In the
process backend, `base` is the host directory standing in for "/" and a
symlink leading out of it is rejected.

Standard library only (imported by the init before pivot_root).
"""
from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import tarfile

MAX_FILE_BYTES = 192 * 1024 * 1024  # below gRPC's 256 MiB message limit
OPS_WITH_DATA = ("write", "untar")
OPS = ("read", "list", "stat", "remove", "mkdir", "rename", "tar", *OPS_WITH_DATA)


class OpError(Exception):
    """A file operation failed; `code` names the class of error for the service."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _file_info(path: str, shown: str) -> dict:
    st = os.lstat(path)
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"
    info = {"name": os.path.basename(shown.rstrip("/")) or "/", "path": shown, "type": kind,
            "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "mtime": st.st_mtime}
    if kind == "symlink":
        info["target"] = os.readlink(path)
    return info


class FileOps:
    """The file operations of one sandbox."""

    def __init__(self, home: str, base: str = "") -> None:
        self.home = home
        self.base = base.rstrip("/")

    def shown(self, path: str) -> str:
        """The path as the sandbox sees it (absolute, normalised); rejects escapes."""
        if not isinstance(path, str) or "\x00" in path:
            raise OpError("invalid_argument", "path must be a string without NUL bytes")
        if ".." in path.split("/"):
            raise OpError("invalid_argument", f"path {path!r} contains '..'; use a path without parent references")
        if not path:
            path = self.home
        if not path.startswith("/"):
            path = self.home.rstrip("/") + "/" + path
        return os.path.normpath(path).replace("//", "/")

    def host(self, shown: str) -> str:
        """Where `shown` lives for this process; with a base directory, symlinks must stay inside it."""
        if not self.base:
            return shown
        full = self.base + shown
        parent = os.path.realpath(os.path.dirname(full))
        if parent != self.base and not parent.startswith(self.base + "/"):
            raise OpError("invalid_argument", f"path {shown!r} leaves the sandbox through a symlink")
        if os.path.islink(full):
            target = os.path.realpath(full)
            if target != self.base and not target.startswith(self.base + "/"):
                raise OpError("invalid_argument", f"path {shown!r} is a symlink out of the sandbox")
        return full

    def op_read(self, req: dict) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        p = self.host(shown)
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            if st.st_size > MAX_FILE_BYTES:
                raise OpError("invalid_argument", f"{shown} is {st.st_size} bytes; the limit is {MAX_FILE_BYTES}; "
                                                  "download it as a tar instead")
            data = f.read(MAX_FILE_BYTES + 1)
        return {"ok": True, "size": len(data)}, data

    def op_write(self, req: dict, data: bytes) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        if shown == "/":
            raise OpError("invalid_argument", "cannot write to '/'")
        parent_shown = os.path.dirname(shown)
        os.makedirs(self.host(parent_shown), exist_ok=True)
        p = self.host(shown)
        mode = int(req.get("mode") or 0o644) & 0o7777
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if req.get("mode"):
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return {"ok": True, "info": _file_info(p, shown)}, b""

    def op_list(self, req: dict) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        depth = max(1, int(req.get("depth") or 1))
        entries: list[dict] = []

        def walk(sh: str, level: int) -> None:
            p = self.host(sh)
            with os.scandir(p) as it:
                items = sorted(it, key=lambda e: e.name)
            for e in items:
                child = (sh.rstrip("/") + "/" + e.name)
                entries.append(_file_info(e.path, child))
                if level < depth and e.is_dir(follow_symlinks=False):
                    walk(child, level + 1)

        if not os.path.isdir(self.host(shown)):
            if os.path.lexists(self.host(shown)):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
            raise FileNotFoundError(errno.ENOENT, "no such directory")
        walk(shown, 1)
        return {"ok": True, "entries": entries}, b""

    def op_stat(self, req: dict) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        return {"ok": True, "info": _file_info(self.host(shown), shown)}, b""

    def op_remove(self, req: dict) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        if shown == "/":
            raise OpError("invalid_argument", "refusing to remove '/'")
        p = self.host(shown)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
        return {"ok": True}, b""

    def op_mkdir(self, req: dict) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        p = self.host(shown)
        existed = os.path.isdir(p)
        os.makedirs(p, exist_ok=True)
        return {"ok": True, "created": not existed, "info": _file_info(p, shown)}, b""

    def op_rename(self, req: dict) -> tuple[dict, bytes]:
        src = self.shown(req.get("path", ""))
        dst = self.shown(req.get("dest", ""))
        os.rename(self.host(src), self.host(dst))
        return {"ok": True, "info": _file_info(self.host(dst), dst)}, b""

    def op_untar(self, req: dict, data: bytes) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        dest = self.host(shown)
        os.makedirs(dest, exist_ok=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                # The "data" filter rejects absolute names, '..', links out of `dest` and device files.
                tar.extractall(dest, filter="data")
        except tarfile.FilterError as e:
            raise OpError("invalid_argument", f"tar member rejected: {e}") from e
        except tarfile.TarError as e:
            raise OpError("invalid_argument", f"not a valid tar archive: {e}") from e
        return {"ok": True}, b""

    def op_tar(self, req: dict) -> tuple[dict, bytes]:
        shown = self.shown(req.get("path", ""))
        p = self.host(shown)
        if not os.path.lexists(p):
            raise FileNotFoundError(errno.ENOENT, "no such file or directory")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(p, arcname=os.path.basename(shown.rstrip("/")) or ".")
        return {"ok": True}, buf.getvalue()

    def run(self, op: str, req: dict, data: bytes) -> tuple[dict, bytes]:
        """Run `op`; failures become {"ok": False, "code", "message"} replies, never exceptions."""
        path = req.get("path")
        try:
            if op in OPS_WITH_DATA:
                return getattr(self, f"op_{op}")(req, data)
            if op in OPS:
                return getattr(self, f"op_{op}")(req)
            raise OpError("invalid_argument", f"unknown operation {op!r}")
        except OpError as e:
            return {"ok": False, "code": e.code, "message": e.message}, b""
        except FileNotFoundError:
            return {"ok": False, "code": "not_found", "message": f"{path}: no such file or directory"}, b""
        except IsADirectoryError:
            return {"ok": False, "code": "invalid_argument", "message": f"{path} is a directory"}, b""
        except NotADirectoryError:
            return {"ok": False, "code": "invalid_argument", "message": f"{path}: not a directory"}, b""
        except FileExistsError:
            return {"ok": False, "code": "already_exists", "message": f"{path} already exists"}, b""
        except OSError as e:
            code = "resource_exhausted" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "failed_precondition"
            return {"ok": False, "code": code, "message": f"{path}: {e.strerror or e}"}, b""
