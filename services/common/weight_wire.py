"""SGLang's weight-update wire format: ForkingPickler + base64, flattened buckets, CUDA UUID mapping.

The payload of `POST /update_weights_from_tensor` is, per tensor-parallel rank,
one string built by SGLang's `MultiprocessingSerializer`: the object pickled
with `multiprocessing.reduction.ForkingPickler` (torch registers reductions
that turn tensors into shared-memory or CUDA-IPC handles) and base64-encoded.
The object is either a list of `(name, tensor)` ("direct") or a flattened
bucket `{"flattened_tensor": 1-D tensor, "metadata": [item, ...]}`.

SGLang 0.5.23 unpickles through an allow-list of exact globals, so a sender
without sglang must send metadata as `types.SimpleNamespace`; `deserialize`
here applies the same kind of allow-list. Two bucket layouts exist:
"bytes" (0.5.23: uint8 storage, byte offsets) and "elements" (0.5.16: one
dtype, element offsets). `unflatten_bucket` reads both.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import logging
import math
import pickle
import threading
import time
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

__all__ = [
    "FlattenedTensorMetadata", "serialize", "deserialize", "flatten_bucket", "unflatten_bucket",
    "bucket_payload", "enable_cuda_uuid_mapping", "use_cpu_shared_memory", "join_weight_update_group",
]

_REDUCTIONS = "torch.multiprocessing.reductions"
# Position of the device index in the argument tuple of torch's CUDA tensor reduction
# (stable for years; SGLang's patch_torch uses the same constant).
_DEVICE_ARG = 6
# ... and of event_sync_required, right after the IPC event handle.
_EVENT_SYNC_ARG = 14


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Receiver-side stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata.

    Payloads pickled by SGLang itself name that class; `deserialize` maps the
    name here so they load without sglang installed. Senders use SimpleNamespace.
    """

    name: str = ""
    shape: torch.Size = dataclasses.field(default_factory=torch.Size)
    dtype: torch.dtype = torch.float32
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.multiprocessing import reductions

    allowed: dict[tuple[str, str], Any] = {
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    }
    for name in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
                 "rebuild_storage_filename", "rebuild_storage_fd", "rebuild_storage_empty",
                 "rebuild_cuda_tensor", "rebuild_nested_tensor", "rebuild_sparse_coo_tensor",
                 "rebuild_sparse_compressed_tensor", "rebuild_meta_tensor"):
        if hasattr(reductions, name):
            allowed[(_REDUCTIONS, name)] = None  # resolved at load time: patches may replace them
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            allowed[("torch", str(value).removeprefix("torch."))] = value
    return allowed


_ALLOWED = _allowed_globals()
# Payloads pickled by a process that runs SGLang's own torch patch name its rebuild function.
_SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")


class _SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the exact (module, name) globals of the wire format.

    `ipc_events`: when a list, every CUDA tensor whose sender asked for a sync
    adds the sender's IPC event (opened here, while the sender holds it) to it.
    PyTorch waits on that event only when it opens the memory for the first
    time; a receiver that reuses open mappings waits on these itself.
    """

    def __init__(self, file: io.BytesIO, ipc_events: list | None = None) -> None:
        super().__init__(file)
        self.ipc_events = ipc_events

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == _SGLANG_CUDA_REBUILD or key == (_REDUCTIONS, "rebuild_cuda_tensor"):
            enable_cuda_uuid_mapping()
            from torch.multiprocessing import reductions
            if self.ipc_events is None:
                return reductions.rebuild_cuda_tensor
            events, rebuild = self.ipc_events, reductions.rebuild_cuda_tensor

            def rebuild_and_keep_event(*args):
                tensor = rebuild(*args)
                if len(args) > _EVENT_SYNC_ARG and args[_EVENT_SYNC_ARG] and args[_EVENT_SYNC_ARG - 1]:
                    events.append(torch.cuda.Event.from_ipc_handle(tensor.device, args[_EVENT_SYNC_ARG - 1]))
                return tensor
            return rebuild_and_keep_event
        if key not in _ALLOWED:
            raise ValueError(f"disallowed global in weight payload: {module}.{name}")
        value = _ALLOWED[key]
        if value is None:
            from torch.multiprocessing import reductions
            value = getattr(reductions, name)
        return value


def serialize(obj: Any) -> str:
    """Pickle `obj` with ForkingPickler (tensors become shm / CUDA-IPC handles) and base64 it.

    The caller must keep the tensors alive and unmodified until the receiver
    replied. For CPU tensors call `use_cpu_shared_memory()` first.
    """
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize(data: str | bytes, ipc_events: list | None = None) -> Any:
    """Decode base64 and unpickle through the allow-list; ValueError names what was refused.
    `ipc_events`: a list that collects the senders' CUDA-IPC events (see _SafeUnpickler)."""
    if isinstance(data, str):
        if not data.isascii():
            raise ValueError("weight payload is not base64 text")
        data = data.encode("ascii")
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"weight payload must be str or bytes, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"weight payload is not valid base64: {exc}") from exc
    try:
        return _SafeUnpickler(io.BytesIO(raw), ipc_events).load()
    except ValueError:
        raise
    except Exception as exc:  # truncated pickle, missing shm segment, bad CUDA handle ...
        raise ValueError(f"weight payload could not be unpickled: {type(exc).__name__}: {exc}") from exc


def bucket_metadata(named_tensors: Sequence[tuple[str, torch.Tensor]],
                    layout: str = "bytes") -> list[types.SimpleNamespace]:
    """SGLang's per-tensor metadata for `named_tensors` packed back to back in this order.

    layout "bytes" (SGLang 0.5.23): offsets and numel in bytes; each tensor's
    offset must be a multiple of its element size (group tensors by dtype,
    largest first, if not). layout "elements" (SGLang 0.5.16): one dtype,
    offsets and numel in elements.
    """
    if layout not in ("bytes", "elements"):
        raise ValueError(f"unknown bucket layout {layout!r}: use 'bytes' or 'elements'")
    if not named_tensors:
        raise ValueError("cannot flatten an empty list of tensors")
    devices = {t.device for _, t in named_tensors}
    if len(devices) > 1:
        raise ValueError(f"tensors of one bucket must share a device, got {sorted(map(str, devices))}")
    dtypes = {t.dtype for _, t in named_tensors}
    if layout == "elements" and len(dtypes) > 1:
        raise ValueError(f"layout 'elements' needs one dtype, got {sorted(map(str, dtypes))}; "
                         "use layout 'bytes' or one bucket per dtype")
    metadata: list[types.SimpleNamespace] = []
    offset = 0
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError("named_tensors must be (str, torch.Tensor) pairs")
        numel = tensor.numel()
        if layout == "bytes":
            if offset % tensor.element_size():
                raise ValueError(
                    f"{name}: byte offset {offset} is not a multiple of {tensor.dtype}'s size "
                    f"{tensor.element_size()}; order tensors by dtype (largest element first) "
                    "or send one bucket per dtype")
            numel *= tensor.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                                              start_idx=offset, end_idx=offset + numel, numel=numel))
        offset += numel
    return metadata


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]],
                   layout: str = "bytes") -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """Pack tensors back to back into one 1-D tensor (uint8 for "bytes") plus `bucket_metadata`."""
    metadata = bucket_metadata(named_tensors, layout)
    parts = [t.detach().contiguous().reshape(-1) for _, t in named_tensors]
    if layout == "bytes":
        parts = [p.view(torch.uint8) for p in parts]
    return torch.cat(parts, dim=0), metadata


def _meta_fields(meta: Any, index: int) -> tuple[str, torch.Size, torch.dtype, int, int, int]:
    try:
        name, shape, dtype = meta.name, meta.shape, meta.dtype
        start, end, numel = meta.start_idx, meta.end_idx, meta.numel
    except AttributeError as exc:
        raise ValueError(f"metadata item {index} lacks an attribute: {exc}") from exc
    if not isinstance(name, str):
        raise ValueError(f"metadata item {index}: name must be a string")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name}: dtype must be a torch.dtype, got {type(dtype).__name__}")
    try:
        shape = torch.Size([int(s) for s in shape])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: shape must be a sequence of ints") from exc
    if any(s < 0 for s in shape):
        raise ValueError(f"{name}: negative dimension in shape {tuple(shape)}")
    for field, value in (("start_idx", start), ("end_idx", end), ("numel", numel)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}: {field} must be an int")
    return name, shape, dtype, start, end, numel


def unflatten_bucket(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """Cut a flattened bucket back into (name, tensor) views; metadata is read by attribute.

    A uint8 `flat` with any non-uint8 metadata dtype is the bytes layout,
    otherwise the elements layout. Every bound is checked; ValueError says why.
    """
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D tensor")
    if not isinstance(metadata, (list, tuple)) or not metadata:
        raise ValueError("metadata must be a non-empty list")
    fields = [_meta_fields(m, i) for i, m in enumerate(metadata)]
    by_bytes = flat.dtype == torch.uint8 and any(f[2] != torch.uint8 for f in fields)
    total = flat.numel()
    out: list[tuple[str, torch.Tensor]] = []
    for name, shape, dtype, start, end, numel in fields:
        if not 0 <= start <= end <= total:
            raise ValueError(f"{name}: range [{start}, {end}) outside the flattened tensor of {total}")
        if end - start != numel:
            raise ValueError(f"{name}: end_idx - start_idx = {end - start} but numel = {numel}")
        count = math.prod(shape)
        if by_bytes:
            size = dtype.itemsize
            if numel != count * size:
                raise ValueError(f"{name}: {numel} bytes do not hold shape {tuple(shape)} of {dtype}")
            if start % size:
                raise ValueError(f"{name}: byte offset {start} is not aligned to {dtype}")
            piece = flat[start:end].view(dtype)
        else:
            if dtype != flat.dtype:
                raise ValueError(f"{name}: dtype {dtype} differs from the flattened tensor's {flat.dtype}")
            if numel != count:
                raise ValueError(f"{name}: {numel} elements do not hold shape {tuple(shape)}")
            piece = flat[start:end]
        out.append((name, piece.reshape(shape)))
    return out


def bucket_payload(flat: torch.Tensor, metadata: list) -> dict:
    """The object SGLang expects for load_format "flattened_bucket"."""
    return {"flattened_tensor": flat, "metadata": metadata}


_patch_lock = threading.Lock()


def _device_to_uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _device_from_maybe_uuid(device: int | str) -> int:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if _device_to_uuid(index) == device:
                return index
        raise ValueError(f"no visible CUDA device has UUID {device}")
    raise ValueError(f"unexpected CUDA device reference {device!r}")


def enable_cuda_uuid_mapping() -> None:
    """Make CUDA-IPC tensor pickles carry the GPU UUID instead of the local index (as SGLang does).

    Sender and receiver may see different CUDA_VISIBLE_DEVICES, so the
    producer's device index is meaningless to the consumer. The patched
    reduction writes the UUID; the patched rebuild (still reachable under
    torch's own name, so a real SGLang receiver resolves its own patched
    version) maps it back to the local index and accepts plain ints too.
    Idempotent; no-op without CUDA or when SGLang's patch is already in place.
    """
    if not torch.cuda.is_available():
        return
    from torch.multiprocessing import reductions

    with _patch_lock:
        if hasattr(reductions, "_reduce_tensor_original"):
            return  # ours or SGLang's: same mechanism, same marker
        original_reduce = reductions.reduce_tensor
        original_rebuild = reductions.rebuild_cuda_tensor

        def reduce_tensor(tensor: torch.Tensor):
            fn, args = original_reduce(tensor)
            if fn is rebuild_cuda_tensor:
                args = (*args[:_DEVICE_ARG], _device_to_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
            return fn, args

        def rebuild_cuda_tensor(*args):
            args = (*args[:_DEVICE_ARG], _device_from_maybe_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
            return original_rebuild(*args)

        # Pickle by torch's name, so any receiver resolves its own (patched or not) rebuild.
        rebuild_cuda_tensor.__module__ = _REDUCTIONS
        rebuild_cuda_tensor.__qualname__ = rebuild_cuda_tensor.__name__ = "rebuild_cuda_tensor"
        reductions._reduce_tensor_original = original_reduce
        reductions._rebuild_cuda_tensor_original = original_rebuild
        reductions.reduce_tensor = reduce_tensor
        reductions.rebuild_cuda_tensor = rebuild_cuda_tensor
        reductions.init_reductions()


_shm_manager_started = False


def use_cpu_shared_memory(attempts: int = 3) -> None:
    """Let CPU tensors cross unrelated processes by shared-memory file name (call in the sender).

    With this strategy torch starts its `torch_shm_manager` helper at the process's first shared
    allocation. That start was once seen to fail ("no response from torch_shm_manager") and succeed
    when tried again, so the helper is started here, with a bounded retry, before anything is shared.
    """
    global _shm_manager_started
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    for attempt in range(1, attempts + 1):
        if _shm_manager_started:
            return
        try:
            torch.zeros(1).share_memory_()
            _shm_manager_started = True
        except RuntimeError as exc:
            if "torch_shm_manager" not in str(exc) or attempt == attempts:
                raise
            log.warning("torch_shm_manager did not start (attempt %d of %d); retrying", attempt, attempts)
            time.sleep(0.2 * attempt)


def join_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "nccl",
                             timeout_s: float = 600.0):
    """Join the trainer↔engine broadcast group the way SGLang does (both sides call this).

    TCP rendezvous at master_address:master_port (rank 0 hosts the store), a
    PrefixStore named after the group, and a process group created without
    touching the default group, so a trainer built for SGLang's engine and
    rlyard's engine agree on keys. Rank 0 is the trainer; `torch.distributed.
    broadcast(t, src=0, group=pg)` then moves tensors. Blocks until all joined.
    """
    import datetime

    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous)

    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
