from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PackedArray(_message.Message):
    __slots__ = ("dtype", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("ms",)
    class MsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MS_FIELD_NUMBER: _ClassVar[int]
    ms: _containers.ScalarMap[str, float]
    def __init__(self, ms: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
