"""The committed gRPC stubs match proto/ (regenerating them changes nothing)."""
import subprocess
import sys
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh():
    proc = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_detects_a_stale_stub(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    stub = gen_proto.OUT_DIR / "rlyard" / "v1" / "common_pb2.py"
    original = stub.read_bytes()
    try:
        stub.write_bytes(original + b"\n# edited by hand\n")
        proc = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 1
        assert "common_pb2.py" in proc.stdout
    finally:
        stub.write_bytes(original)


def test_every_field_is_commented():
    """Contracts first: each field of every message carries a comment line above it."""
    missing = []
    for proto in (ROOT / "proto").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("//", "option", "syntax", "package", "import"))
            if is_field and not any(t.isupper() and "_" in t for t in s.split()[:1]):
                prev = lines[i - 1].strip()
                if not (prev.startswith("//") or lines[i - 1].strip().endswith(";") and _shared_comment(lines, i)):
                    missing.append(f"{proto.name}:{i + 1}: {s}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)


def _shared_comment(lines, i):
    # `double started_at = 8; double ended_at = 9;` under one comment
    j = i - 1
    while j >= 0 and lines[j].strip().endswith(";") and not lines[j].strip().startswith("//"):
        j -= 1
    return j >= 0 and lines[j].strip().startswith("//") and i - j <= 2
