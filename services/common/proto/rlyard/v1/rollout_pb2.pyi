from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_PENDING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_SUCCEEDED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_PENDING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_SUCCEEDED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_STOPPED: RunState

class StartRunRequest(_message.Message):
    __slots__ = ("config", "name")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    config: str
    name: str
    def __init__(self, config: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run_id", "name", "state", "step", "total_steps", "config_json", "message", "started_at", "ended_at", "last_metrics", "run_dir")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    state: RunState
    step: int
    total_steps: int
    config_json: str
    message: str
    started_at: float
    ended_at: float
    last_metrics: _containers.ScalarMap[str, float]
    run_dir: str
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., config_json: _Optional[str] = ..., message: _Optional[str] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., run_dir: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[RunState]
    def __init__(self, states: _Optional[_Iterable[_Union[RunState, str]]] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunInfo, _Mapping]]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("step", "eval", "state", "log", "progress")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    step: StepMetrics
    eval: StepMetrics
    state: RunInfo
    log: str
    progress: StepProgress
    def __init__(self, step: _Optional[_Union[StepMetrics, _Mapping]] = ..., eval: _Optional[_Union[StepMetrics, _Mapping]] = ..., state: _Optional[_Union[RunInfo, _Mapping]] = ..., log: _Optional[str] = ..., progress: _Optional[_Union[StepProgress, _Mapping]] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("step", "phase", "done", "total", "failed")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    step: int
    phase: str
    done: int
    total: int
    failed: int
    def __init__(self, step: _Optional[int] = ..., phase: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...
