"""Generate the Python gRPC stubs from proto/ into services/common/proto/.

protoc writes imports as `from rlyard.v1 import x_pb2`; they are rewritten to
the package path `services.common.proto.rlyard.v1` so the stubs import without
touching sys.path. `--check` regenerates into a temporary folder and exits 1
when the committed stubs differ (used by the staleness test and CI).
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "services" / "common" / "proto"
PKG = "services.common.proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on every .proto file and return the generated files."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    files = sorted(p for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi"))
    for path in files:
        text = path.read_text()
        text = re.sub(r"^from rlyard\.v1 import", f"from {PKG}.rlyard.v1 import", text, flags=re.M)
        text = re.sub(r"^import rlyard\.v1\.", f"import {PKG}.rlyard.v1.", text, flags=re.M)
        path.write_text(text)
    for pkg_dir in {out_dir, *(p.parent for p in files), *(p.parent.parent for p in files)}:
        if pkg_dir == out_dir or out_dir in pkg_dir.parents:
            (pkg_dir / "__init__.py").touch()
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_dir = pathlib.Path(tmp)
            generate(tmp_dir)
            stale = []
            for new in tmp_dir.rglob("*.py*"):
                old = OUT_DIR / new.relative_to(tmp_dir)
                if not old.exists() or not filecmp.cmp(old, new, shallow=False):
                    stale.append(str(old.relative_to(ROOT)))
            if stale:
                print("stale generated stubs (run `make proto`):", *stale, sep="\n  ")
                return 1
            print("generated stubs are up to date")
            return 0
    shutil.rmtree(OUT_DIR / "rlyard", ignore_errors=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for path in generate(OUT_DIR):
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
