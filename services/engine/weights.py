"""Weight updates for the engine: decode SGLang payloads, validate every tensor, then copy all at once.

Validation (names, shapes, finite dtypes) happens before the first copy, so
a bad update changes nothing. The copy itself runs in the scheduler thread
between decode steps (see `Scheduler.call`), as one multi-tensor copy per
device.

CUDA-IPC handles: opening one maps the sender's memory, which costs
milliseconds, and PyTorch reuses an open mapping only while someone still
holds it. `IpcMappings` holds the few most recent ones, so a trainer that
sends from the same staging buffers every sync (rlyard's does) pays that
once.
"""
from __future__ import annotations

import collections
import dataclasses
import pathlib
import threading
from typing import Any

import torch

from services.common import weight_wire
from services.engine.model import ModelRunner

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """A weight update was refused; the model is unchanged."""


@dataclasses.dataclass
class _Held:
    """One held buffer: its storage, the views last cut from it (and their metadata signature),
    and the parameter match of those views per model."""

    storage: torch.UntypedStorage
    sig: Any = None
    named: NamedTensors | None = None
    matched: dict[int, tuple[Any, list]] = dataclasses.field(default_factory=dict)


class IpcMappings:
    """Keeps the CUDA storages of the last `size` payload buffers alive (see module doc), with the
    views cut from them and their match to the parameters, so the same buffer with the same
    metadata is decoded and checked without any per-tensor work.

    A sender that frees a buffer we still hold only leaves its memory mapped here
    until `size` newer buffers have arrived; `clear()` lets them all go at once.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._held: collections.OrderedDict[int, _Held] = collections.OrderedDict()  # by storage data_ptr
        self._lock = threading.Lock()
        self.reused = 0  # decodes served from held views (observable in tests and logs)

    def _entry(self, t: torch.Tensor) -> _Held:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self._held.pop(key, None) or _Held(storage)
        self._held[key] = entry
        while len(self._held) > self.size:
            self._held.popitem(last=False)
        return entry

    def hold(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                if t.is_cuda:
                    self._entry(t)

    def unflatten(self, flat: torch.Tensor, metadata: Any) -> NamedTensors:
        """weight_wire.unflatten_bucket, remembered per held CUDA buffer and metadata."""
        if not isinstance(flat, torch.Tensor) or not flat.is_cuda:
            return weight_wire.unflatten_bucket(flat, metadata)
        try:
            sig = (flat.storage_offset(), flat.numel(), flat.dtype,
                   tuple((m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in metadata))
        except (AttributeError, TypeError):  # malformed: let unflatten_bucket say exactly what is wrong
            return weight_wire.unflatten_bucket(flat, metadata)
        with self._lock:
            entry = self._entry(flat)
            if entry.named is not None and entry.sig == sig:
                self.reused += 1
                return entry.named
        named = weight_wire.unflatten_bucket(flat, metadata)
        with self._lock:  # one layout per buffer is what senders do: keep the newest
            entry.sig, entry.named, entry.matched = sig, named, {}
        return named

    def matched(self, named: NamedTensors, runner: Any, match: Any) -> list:
        """`match(runner, named)`, remembered while `named` is a held views list (anything else,
        e.g. a CPU payload, is matched every time and not kept)."""
        with self._lock:
            entry = next((e for e in self._held.values() if e.named is named), None)
            done = entry.matched.get(id(runner)) if entry is not None else None
        if done is not None and done[0] is runner:
            return done[1]
        pairs = match(runner, named)
        if entry is not None:
            with self._lock:
                entry.matched[id(runner)] = (runner, pairs)
        return pairs

    def clear(self) -> None:
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


IPC_MAPPINGS = IpcMappings()


def decode_tensor_payload(serialized: Any, load_format: str | None,
                          ipc_events: list | None = None) -> NamedTensors:
    """Turn `serialized_named_tensors` (one base64 string per TP rank; we are rank 0) into (name, tensor).
    `ipc_events` collects the senders' CUDA-IPC events; `apply` must wait on them."""
    if not isinstance(serialized, list) or not serialized or not isinstance(serialized[0], (str, bytes)):
        raise WeightUpdateError("serialized_named_tensors must be a non-empty list of base64 strings")
    if load_format not in (None, "direct", "flattened_bucket"):
        raise WeightUpdateError(f"unsupported load_format {load_format!r}: use null, 'direct' or 'flattened_bucket'")
    try:
        obj = weight_wire.deserialize(serialized[0], ipc_events)
    except ValueError as exc:
        raise WeightUpdateError(str(exc)) from exc
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or set(obj) < {"flattened_tensor", "metadata"}:
            raise WeightUpdateError("flattened_bucket payload must be a dict with flattened_tensor and metadata")
        try:
            return IPC_MAPPINGS.unflatten(obj["flattened_tensor"], obj["metadata"])
        except ValueError as exc:
            raise WeightUpdateError(f"bad flattened bucket: {exc}") from exc
    if isinstance(obj, dict) and "flattened_tensor" in obj:
        raise WeightUpdateError("payload is a flattened bucket: send load_format 'flattened_bucket'")
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, (list, tuple)) or not obj:
        raise WeightUpdateError("direct payload must be a non-empty list of (name, tensor) pairs")
    named: NamedTensors = []
    for item in obj:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)):
            raise WeightUpdateError("direct payload items must be (name, tensor) pairs")
        named.append((item[0], item[1]))
    IPC_MAPPINGS.hold([t for _, t in named])
    return named


def check(runner: ModelRunner, named: NamedTensors) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Match each name to a parameter and check shapes; WeightUpdateError lists every problem.
    A views list that IpcMappings hands out again is matched once (the parameters stay put)."""
    return IPC_MAPPINGS.matched(named, runner, _match)


def _match(runner: ModelRunner, named: NamedTensors) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    params = runner.named_parameters()
    pairs, problems = [], []
    for name, tensor in named:
        param = params.get(name)
        if param is None:
            problems.append(f"unknown parameter {name}")
        elif tuple(tensor.shape) != tuple(param.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(param.shape)}")
        elif tensor.is_complex() or not (tensor.is_floating_point() or tensor.dtype == param.dtype):
            problems.append(f"{name}: dtype {tensor.dtype} cannot load into {param.dtype}")
        else:
            pairs.append((param, tensor))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightUpdateError(f"weight update refused, model unchanged: {shown}")
    return pairs


@torch.inference_mode()
def apply(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]], ipc_events: list | None = None) -> int:
    """Copy validated tensors into the parameters; waits for the copies (CUDA IPC senders free after reply).
    The copies are queued behind `ipc_events`: a sender may post a buffer whose filling copy is still
    running and mark its end with the event it shares (PyTorch's IPC protocol)."""
    for event in ipc_events or ():
        torch.cuda.current_stream(event.device).wait_event(event)
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for param, tensor in pairs:  # one multi-tensor kernel per (devices, dtype) instead of one copy each
        dst, src = groups.setdefault((param.device, tensor.device, param.dtype == tensor.dtype), ([], []))
        dst.append(param.data)
        src.append(tensor)
    for (_, _, same_dtype), (dst, src) in groups.items():
        if same_dtype:
            torch._foreach_copy_(dst, src)
        else:
            for d, t in zip(dst, src):
                d.copy_(t)
    devices = {p.device for p, _ in pairs} | {t.device for _, t in pairs}
    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return len(pairs)


def read_checkpoint(path: pathlib.Path) -> NamedTensors:
    """All tensors of a HF folder (*.safetensors, else pytorch_model*.bin loaded weights-only)."""
    files = sorted(path.glob("*.safetensors"))
    named: NamedTensors = []
    if files:
        from safetensors.torch import load_file
        for f in files:
            named.extend(load_file(str(f)).items())
        return named
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise WeightUpdateError(f"{path} holds no *.safetensors or pytorch_model*.bin weights")
    for f in bins:
        named.extend(torch.load(f, map_location="cpu", weights_only=True).items())
    return named


class UpdateGroup:
    """One trainer→engine broadcast group (rank 0 = trainer) created by /init_weights_update_group."""

    def __init__(self, pg: Any, device: torch.device) -> None:
        self.pg = pg
        self.device = device

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None) -> NamedTensors:
        """Receive the trainer's broadcast, tensor by tensor in `names` order (or one uint8 bucket)."""
        import torch.distributed as dist

        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightUpdateError("names, dtypes and shapes must be non-empty lists of the same length")
        specs = []
        for name, dt, shape in zip(names, dtypes, shapes):
            dtype = getattr(torch, str(dt).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise WeightUpdateError(f"{name}: unknown dtype {dt!r}")
            if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise WeightUpdateError(f"{name}: shape must be a list of non-negative ints")
            specs.append((name, dtype, shape))
        if load_format == "flattened_bucket":
            import types
            meta, offset = [], 0
            for name, dtype, shape in specs:
                size = torch.Size(shape).numel() * dtype.itemsize
                meta.append(types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype,
                                                  start_idx=offset, end_idx=offset + size, numel=size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=0, group=self.pg)
            return weight_wire.unflatten_bucket(flat, meta)
        out: NamedTensors = []
        for name, dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(t, src=0, group=self.pg)
            out.append((name, t))
        return out

    def destroy(self) -> None:
        import torch.distributed as dist
        dist.destroy_process_group(self.pg)
