"""Load SGLang's own pure-torch `weight_sync/tensor_bucket.py` for interop tests, from its PyPI wheel.

The wheel is fetched once with `pip download sglang==<v> --no-deps` into
~/.cache/rlyard/sglang-wheels (or $RLYARD_SGLANG_WHEELS); only that one file is
extracted, into a temp dir, at test time. No SGLang code lives in the repo.
Tests skip with the reason when the wheel cannot be obtained.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import types
import zipfile

import pytest

_MEMBER = "sglang/srt/weight_sync/tensor_bucket.py"
MODULE = "sglang.srt.weight_sync.tensor_bucket"
_loaded: dict[str, types.ModuleType] = {}


def _wheel_dir() -> pathlib.Path:
    root = os.environ.get("RLYARD_SGLANG_WHEELS") or os.path.expanduser("~/.cache/rlyard/sglang-wheels")
    return pathlib.Path(root)


def _wheel(version: str) -> pathlib.Path:
    folder = _wheel_dir()
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps",
                           "-q", "-d", str(folder)], capture_output=True, text=True, timeout=300)
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if proc.returncode or not found:
        pytest.skip(f"sglang {version} wheel not obtainable from PyPI: {proc.stderr.strip()[-300:]}")
    return found[0]


def tensor_bucket_module(version: str = "0.5.23") -> types.ModuleType:
    """SGLang's tensor_bucket module of `version`, imported from a temp copy (skips if unavailable)."""
    if version in _loaded:
        return _loaded[version]
    try:
        wheel = _wheel(version)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"sglang {version} wheel not obtainable: {exc}")
    target = pathlib.Path(tempfile.mkdtemp(prefix=f"sglang-{version}-")) / "tensor_bucket.py"
    with zipfile.ZipFile(wheel) as zf:
        target.write_bytes(zf.read(_MEMBER))
    # Imported under SGLang's real module path, so its classes pickle exactly as SGLang's do.
    spec = importlib.util.spec_from_file_location(MODULE, target)
    module = importlib.util.module_from_spec(spec)
    with importable(module):
        spec.loader.exec_module(module)
    _loaded[version] = module
    return module


@contextlib.contextmanager
def importable(module: types.ModuleType):
    """Make `module` importable under SGLang's path (for pickling), then remove every trace of it."""
    parts = MODULE.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = module if i == len(parts) else types.ModuleType(name)
            added.append(name)
    try:
        yield module
    finally:
        for name in added:
            sys.modules.pop(name, None)
