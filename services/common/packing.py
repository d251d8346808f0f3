"""Pack 1-D token and log-prob arrays into `PackedArray` bytes and back.

Token arrays travel as little-endian int32 or float32 bytes, not as repeated
protobuf scalars: a 4,000-token episode is one 16 KB field instead of 4,000
varints.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from services.common.proto.rlyard.v1 import common_pb2

_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}


def pack(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: str) -> common_pb2.PackedArray:
    """Pack a 1-D sequence as `dtype` ("int32" or "float32")."""
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported packed dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    arr = np.asarray(values, dtype=_DTYPES[dtype])
    if arr.ndim != 1:
        raise ValueError(f"packed arrays are 1-D, got shape {arr.shape}")
    return common_pb2.PackedArray(dtype=dtype, data=arr.tobytes())


def unpack(packed: common_pb2.PackedArray, expect: str | None = None) -> np.ndarray:
    """Return the array held by `packed`; raise ValueError if it is malformed."""
    if packed.dtype not in _DTYPES:
        raise ValueError(f"unsupported packed dtype {packed.dtype!r}")
    if expect is not None and packed.dtype != expect:
        raise ValueError(f"expected a {expect} array, got {packed.dtype}")
    dt = _DTYPES[packed.dtype]
    if len(packed.data) % dt.itemsize:
        raise ValueError(f"{len(packed.data)} bytes is not a whole number of {packed.dtype} values")
    return np.frombuffer(packed.data, dtype=dt)


def pack_ids(ids: Sequence[int] | np.ndarray) -> common_pb2.PackedArray:
    """Pack token ids (int32)."""
    return pack(ids, "int32")


def pack_floats(values: Sequence[float] | np.ndarray) -> common_pb2.PackedArray:
    """Pack float values (float32)."""
    return pack(values, "float32")
