from services.common.proto.rlyard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossConfig(_message.Message):
    __slots__ = ("eps_low", "eps_high", "dual_clip_c", "aggregation", "kl_coef", "tis_cap", "lr", "temperature")
    EPS_LOW_FIELD_NUMBER: _ClassVar[int]
    EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_C_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    eps_low: float
    eps_high: float
    dual_clip_c: float
    aggregation: str
    kl_coef: float
    tis_cap: float
    lr: float
    temperature: float
    def __init__(self, eps_low: _Optional[float] = ..., eps_high: _Optional[float] = ..., dual_clip_c: _Optional[float] = ..., aggregation: _Optional[str] = ..., kl_coef: _Optional[float] = ..., tis_cap: _Optional[float] = ..., lr: _Optional[float] = ..., temperature: _Optional[float] = ...) -> None: ...

class StepHeader(_message.Message):
    __slots__ = ("expected_policy_version", "num_episodes", "loss", "step_id")
    EXPECTED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_EPISODES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    expected_policy_version: int
    num_episodes: int
    loss: LossConfig
    step_id: str
    def __init__(self, expected_policy_version: _Optional[int] = ..., num_episodes: _Optional[int] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., step_id: _Optional[str] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "advantage", "policy_version", "weight")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _common_pb2.PackedArray
    response_ids: _common_pb2.PackedArray
    loss_mask: _common_pb2.PackedArray
    rollout_logprobs: _common_pb2.PackedArray
    advantage: float
    policy_version: int
    weight: float
    def __init__(self, prompt_ids: _Optional[_Union[_common_pb2.PackedArray, _Mapping]] = ..., response_ids: _Optional[_Union[_common_pb2.PackedArray, _Mapping]] = ..., loss_mask: _Optional[_Union[_common_pb2.PackedArray, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[_common_pb2.PackedArray, _Mapping]] = ..., advantage: _Optional[float] = ..., policy_version: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class TrainStepChunk(_message.Message):
    __slots__ = ("header", "episode")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    header: StepHeader
    episode: Episode
    def __init__(self, header: _Optional[_Union[StepHeader, _Mapping]] = ..., episode: _Optional[_Union[Episode, _Mapping]] = ...) -> None: ...

class TrainStepResult(_message.Message):
    __slots__ = ("step", "policy_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("engine_urls", "method", "weight_version", "bucket_mb", "flush_cache")
    ENGINE_URLS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_MB_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    engine_urls: _containers.RepeatedScalarFieldContainer[str]
    method: str
    weight_version: str
    bucket_mb: int
    flush_cache: bool
    def __init__(self, engine_urls: _Optional[_Iterable[str]] = ..., method: _Optional[str] = ..., weight_version: _Optional[str] = ..., bucket_mb: _Optional[int] = ..., flush_cache: _Optional[bool] = ...) -> None: ...

class SyncWeightsResult(_message.Message):
    __slots__ = ("weight_version", "bytes", "buckets", "timing", "method")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    bytes: int
    buckets: int
    timing: _common_pb2.Timing
    method: str
    def __init__(self, weight_version: _Optional[str] = ..., bytes: _Optional[int] = ..., buckets: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., method: _Optional[str] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("path", "step", "policy_version", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    policy_version: int
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("model", "device", "dtype", "step", "policy_version", "num_parameters", "peak_memory_gb", "synced_weight_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    SYNCED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    device: str
    dtype: str
    step: int
    policy_version: int
    num_parameters: int
    peak_memory_gb: float
    synced_weight_version: str
    def __init__(self, model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., num_parameters: _Optional[int] = ..., peak_memory_gb: _Optional[float] = ..., synced_weight_version: _Optional[str] = ...) -> None: ...
