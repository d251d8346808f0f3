from services.common.proto.rlyard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_CREATING: _ClassVar[SandboxState]
    SANDBOX_STATE_RUNNING: _ClassVar[SandboxState]
    SANDBOX_STATE_PAUSING: _ClassVar[SandboxState]
    SANDBOX_STATE_PAUSED: _ClassVar[SandboxState]
    SANDBOX_STATE_RESUMING: _ClassVar[SandboxState]
    SANDBOX_STATE_SNAPSHOTTING: _ClassVar[SandboxState]
    SANDBOX_STATE_FORKING: _ClassVar[SandboxState]
    SANDBOX_STATE_KILLING: _ClassVar[SandboxState]
    SANDBOX_STATE_KILLED: _ClassVar[SandboxState]
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_CREATING: SandboxState
SANDBOX_STATE_RUNNING: SandboxState
SANDBOX_STATE_PAUSING: SandboxState
SANDBOX_STATE_PAUSED: SandboxState
SANDBOX_STATE_RESUMING: SandboxState
SANDBOX_STATE_SNAPSHOTTING: SandboxState
SANDBOX_STATE_FORKING: SandboxState
SANDBOX_STATE_KILLING: SandboxState
SANDBOX_STATE_KILLED: SandboxState

class SandboxRef(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("memory_mb", "pids", "cpu_millis", "disk_mb")
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    memory_mb: int
    pids: int
    cpu_millis: int
    disk_mb: int
    def __init__(self, memory_mb: _Optional[int] = ..., pids: _Optional[int] = ..., cpu_millis: _Optional[int] = ..., disk_mb: _Optional[int] = ...) -> None: ...

class NetworkPolicy(_message.Message):
    __slots__ = ("allow_egress", "allow_domains", "allow_cidrs")
    ALLOW_EGRESS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DOMAINS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_CIDRS_FIELD_NUMBER: _ClassVar[int]
    allow_egress: bool
    allow_domains: _containers.RepeatedScalarFieldContainer[str]
    allow_cidrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, allow_egress: _Optional[bool] = ..., allow_domains: _Optional[_Iterable[str]] = ..., allow_cidrs: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("template", "snapshot_id", "timeout_s", "auto_pause", "env", "metadata", "resources", "network")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    AUTO_PAUSE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    template: str
    snapshot_id: str
    timeout_s: int
    auto_pause: bool
    env: _containers.ScalarMap[str, str]
    metadata: _containers.ScalarMap[str, str]
    resources: Resources
    network: NetworkPolicy
    def __init__(self, template: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., timeout_s: _Optional[int] = ..., auto_pause: _Optional[bool] = ..., env: _Optional[_Mapping[str, str]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ...) -> None: ...

class SandboxInfo(_message.Message):
    __slots__ = ("sandbox_id", "state", "template", "backend", "created_at", "expires_at", "metadata", "resources", "parent_id", "snapshot_kind", "auto_pause")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KIND_FIELD_NUMBER: _ClassVar[int]
    AUTO_PAUSE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    state: SandboxState
    template: str
    backend: str
    created_at: float
    expires_at: float
    metadata: _containers.ScalarMap[str, str]
    resources: Resources
    parent_id: str
    snapshot_kind: str
    auto_pause: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., state: _Optional[_Union[SandboxState, str]] = ..., template: _Optional[str] = ..., backend: _Optional[str] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., parent_id: _Optional[str] = ..., snapshot_kind: _Optional[str] = ..., auto_pause: _Optional[bool] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("states", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[SandboxState]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, states: _Optional[_Iterable[_Union[SandboxState, str]]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("sandbox_id", "argv", "shell", "cwd", "env", "stdin", "timeout_s", "max_output_bytes")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    stdin: bytes
    timeout_s: float
    max_output_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., stdin: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., max_output_bytes: _Optional[int] = ...) -> None: ...

class ExecResult(_message.Message):
    __slots__ = ("exit_code", "stdout", "stderr", "timed_out", "stdout_truncated", "stderr_truncated", "duration_ms")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_ms: float
    def __init__(self, exit_code: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., timed_out: _Optional[bool] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class ExecEvent(_message.Message):
    __slots__ = ("started_pid", "stdout", "stderr", "end")
    STARTED_PID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    started_pid: int
    stdout: bytes
    stderr: bytes
    end: ExecResult
    def __init__(self, started_pid: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., end: _Optional[_Union[ExecResult, _Mapping]] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "data", "mode")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    data: bytes
    mode: int
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "path", "type", "size", "mode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    type: str
    size: int
    mode: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., type: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ListDirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ListDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UploadTarRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "tar")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAR_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    tar: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., tar: _Optional[bytes] = ...) -> None: ...

class DownloadTarRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class DownloadTarResponse(_message.Message):
    __slots__ = ("tar",)
    TAR_FIELD_NUMBER: _ClassVar[int]
    tar: bytes
    def __init__(self, tar: _Optional[bytes] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("sandbox_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, sandbox_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("snapshot_id", "source_sandbox_id", "kind", "duration_ms", "created_at")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    source_sandbox_id: str
    kind: str
    duration_ms: float
    created_at: float
    def __init__(self, snapshot_id: _Optional[str] = ..., source_sandbox_id: _Optional[str] = ..., kind: _Optional[str] = ..., duration_ms: _Optional[float] = ..., created_at: _Optional[float] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("sandbox_id", "count", "timeout_s")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    count: int
    timeout_s: int
    def __init__(self, sandbox_id: _Optional[str] = ..., count: _Optional[int] = ..., timeout_s: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("children", "kind", "duration_ms")
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    kind: str
    duration_ms: float
    def __init__(self, children: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ..., kind: _Optional[str] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class SetTimeoutRequest(_message.Message):
    __slots__ = ("sandbox_id", "timeout_s")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    timeout_s: int
    def __init__(self, sandbox_id: _Optional[str] = ..., timeout_s: _Optional[int] = ...) -> None: ...

class TemplateInfo(_message.Message):
    __slots__ = ("name", "path", "size_bytes", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    size_bytes: int
    source: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class ListTemplatesResponse(_message.Message):
    __slots__ = ("templates", "default_template")
    TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    templates: _containers.RepeatedCompositeFieldContainer[TemplateInfo]
    default_template: str
    def __init__(self, templates: _Optional[_Iterable[_Union[TemplateInfo, _Mapping]]] = ..., default_template: _Optional[str] = ...) -> None: ...
