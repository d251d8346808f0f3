"""weight_wire: SGLang's weight-update wire format (serialize, allow-list, buckets, CPU shm across processes)."""
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from services.common import weight_wire as ww
from tests.engine.sglang_source import importable, tensor_bucket_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _named():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=g)),
            ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.ids", torch.arange(6, dtype=torch.int16).reshape(2, 3))]


def _same(left, right):
    assert [n for n, _ in left] == [n for n, _ in right]
    for (_, x), (_, y) in zip(left, right):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_bytes_layout_roundtrip_mixed_dtypes():
    named = _named()
    flat, meta = ww.flatten_bucket(named)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert all(isinstance(m, types.SimpleNamespace) for m in meta)
    assert meta[0].start_idx == 0 and meta[0].end_idx == meta[0].numel == 15 * 4
    assert meta[1].start_idx == 60 and meta[1].numel == 14
    _same(ww.unflatten_bucket(flat, meta), named)


def test_elements_layout_roundtrip_and_mixed_dtype_refused():
    named = [("x", torch.randn(2, 3)), ("y", torch.randn(4))]
    flat, meta = ww.flatten_bucket(named, layout="elements")
    assert flat.dtype == torch.float32 and flat.numel() == 10
    assert (meta[1].start_idx, meta[1].end_idx, meta[1].numel) == (6, 10, 4)
    _same(ww.unflatten_bucket(flat, meta), named)
    with pytest.raises(ValueError, match="one dtype"):
        ww.flatten_bucket(_named(), layout="elements")


def test_misaligned_bytes_layout_refused():
    named = [("odd", torch.zeros(3, dtype=torch.bfloat16)), ("f", torch.zeros(2))]
    with pytest.raises(ValueError, match="not a multiple"):
        ww.flatten_bucket(named)
    with pytest.raises(ValueError, match="empty"):
        ww.flatten_bucket([])


@pytest.mark.parametrize("mutate, reason", [
    (lambda m: setattr(m, "end_idx", 10_000), "outside"),
    (lambda m: setattr(m, "numel", 3), "numel"),
    (lambda m: setattr(m, "shape", torch.Size([4, 5])), "do not hold"),
    (lambda m: setattr(m, "dtype", "float32"), "torch.dtype"),
    (lambda m: delattr(m, "name"), "lacks an attribute"),
])
def test_unflatten_validates(mutate, reason):
    flat, meta = ww.flatten_bucket(_named())
    mutate(meta[0])
    with pytest.raises(ValueError, match=reason):
        ww.unflatten_bucket(flat, meta)


def test_serialize_roundtrip_in_process():
    ww.use_cpu_shared_memory()
    flat, meta = ww.flatten_bucket(_named())
    payload = ww.deserialize(ww.serialize(ww.bucket_payload(flat, meta)))
    assert set(payload) == {"flattened_tensor", "metadata"}
    assert payload["metadata"][1].dtype == torch.bfloat16
    _same(ww.unflatten_bucket(payload["flattened_tensor"], payload["metadata"]), _named())
    direct = ww.deserialize(ww.serialize(_named()).encode())
    _same(direct, _named())


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_disallowed_global_is_named():
    data = ww.serialize([("x", _Evil())])
    with pytest.raises(ValueError, match=r"disallowed global.*system"):
        ww.deserialize(data)


@pytest.mark.parametrize("data, reason", [("@@not base64@@", "base64"), ("aGVsbG8=", "unpickled"),
                                          ("é", "base64")])
def test_bad_payloads(data, reason):
    with pytest.raises(ValueError, match=reason):
        ww.deserialize(data)


def test_cross_process_cpu_shared_memory():
    """A sender in another process (file_system strategy) ships a bucket; we read the same bytes."""
    sender = textwrap.dedent("""
        import sys, torch
        from services.common import weight_wire as ww
        ww.use_cpu_shared_memory()
        g = torch.Generator().manual_seed(1)
        named = [("w", torch.randn(64, 32, generator=g)), ("h", torch.randn(9, generator=g).half())]
        flat, meta = ww.flatten_bucket(named)
        print(ww.serialize(ww.bucket_payload(flat, meta)), flush=True)
        sys.stdin.readline()  # keep the tensors alive until the receiver is done
    """)
    proc = subprocess.Popen([sys.executable, "-c", sender], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        payload = ww.deserialize(line)
        got = [(n, t.clone()) for n, t in ww.unflatten_bucket(payload["flattened_tensor"], payload["metadata"])]
    finally:
        proc.communicate("done\n", timeout=30)
    g = torch.Generator().manual_seed(1)
    _same(got, [("w", torch.randn(64, 32, generator=g)), ("h", torch.randn(9, generator=g).half())])


def test_sglang_tensor_bucket_reads_our_buckets():
    sgl = tensor_bucket_module("0.5.23")
    named = _named()
    flat, meta = ww.flatten_bucket(named)
    payload = ww.deserialize(ww.serialize(ww.bucket_payload(flat, meta)))
    converted = [sgl.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                             end_idx=m.end_idx, numel=m.numel) for m in payload["metadata"]]
    bucket = sgl.FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=converted)
    _same(bucket.reconstruct_tensors(), named)


def test_sglang_made_buckets_decode_here_without_sglang():
    sgl = tensor_bucket_module("0.5.23")
    named = _named()
    bucket = sgl.FlattenedTensorBucket(named_tensors=named)
    with importable(sgl):  # pickled by SGLang's own class path, as an SGLang sender would
        data = ww.serialize({"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()})
    assert b"sglang.srt.weight_sync.tensor_bucket" in __import__("base64").b64decode(data)
    assert "sglang.srt.weight_sync.tensor_bucket" not in sys.modules
    payload = ww.deserialize(data)
    assert isinstance(payload["metadata"][0], ww.FlattenedTensorMetadata)
    _same(ww.unflatten_bucket(payload["flattened_tensor"], payload["metadata"]), named)


def test_sglang_0_5_16_tensor_bucket_agrees():
    sgl = tensor_bucket_module("0.5.16")
    named = _named()
    bucket = sgl.FlattenedTensorBucket(named_tensors=named)
    flat, meta = ww.flatten_bucket(named)
    assert torch.equal(bucket.get_flattened_tensor(), flat)
    assert [(m.start_idx, m.end_idx, m.numel) for m in bucket.get_metadata()] == \
        [(m.start_idx, m.end_idx, m.numel) for m in meta]


def test_uuid_mapping_is_noop_without_cuda():
    from torch.multiprocessing import reductions
    before = reductions.reduce_tensor
    ww.enable_cuda_uuid_mapping()
    ww.enable_cuda_uuid_mapping()
    if not torch.cuda.is_available():
        assert reductions.reduce_tensor is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_carries_uuid():
    ww.enable_cuda_uuid_mapping()
    t = torch.arange(10, device="cuda:0", dtype=torch.float32)
    raw = __import__("base64").b64decode(ww.serialize([("t", t)]))
    assert str(torch.cuda.get_device_properties(0).uuid).encode() in raw


def test_cpu_shared_memory_starts_torch_shm_manager():
    """After use_cpu_shared_memory(), a shared CPU tensor pickles as a file name (no fd handover)."""
    import torch.multiprocessing
    ww.use_cpu_shared_memory()
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    assert ww._shm_manager_started
    t = torch.arange(4.0).share_memory_()
    assert ww.deserialize(ww.serialize(t)).tolist() == [0.0, 1.0, 2.0, 3.0]
