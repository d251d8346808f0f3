"""PackedArray round trips and rejects malformed payloads."""
import numpy as np
import pytest

from services.common import packing
from services.common.proto.rlyard.v1 import common_pb2


def test_round_trip_ids_and_floats():
    ids = [0, 1, 49151, 2**31 - 1]
    packed = packing.pack_ids(ids)
    assert packed.dtype == "int32" and len(packed.data) == 16
    assert packing.unpack(packed, expect="int32").tolist() == ids
    vals = [0.0, -1.5, 3.25]
    assert packing.unpack(packing.pack_floats(vals)).tolist() == vals


def test_survives_protobuf_serialisation():
    packed = packing.pack_floats(np.linspace(-3, 0, 1000))
    again = common_pb2.PackedArray.FromString(packed.SerializeToString())
    np.testing.assert_allclose(packing.unpack(again), np.linspace(-3, 0, 1000).astype(np.float32))


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="unsupported"):
        packing.pack([1], "int64")
    with pytest.raises(ValueError, match="1-D"):
        packing.pack([[1, 2]], "int32")
    with pytest.raises(ValueError, match="whole number"):
        packing.unpack(common_pb2.PackedArray(dtype="int32", data=b"\x00\x01\x02"))
    with pytest.raises(ValueError, match="expected a float32"):
        packing.unpack(packing.pack_ids([1]), expect="float32")
