"""Weight updates for the engine: decode SGLang payloads, validate every tensor, then copy all at once.

Validation (names, shapes, finite dtypes) happens before the first copy, so
a bad update changes nothing. The copy itself runs in the scheduler thread
between decode steps (see `Scheduler.call`).
"""
from __future__ import annotations

import pathlib
from typing import Any

import torch

from services.common import weight_wire
from services.engine.model import ModelRunner

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """A weight update was refused; the model is unchanged."""


def decode_tensor_payload(serialized: Any, load_format: str | None) -> NamedTensors:
    """Turn `serialized_named_tensors` (one base64 string per TP rank; we are rank 0) into (name, tensor)."""
    if not isinstance(serialized, list) or not serialized or not isinstance(serialized[0], (str, bytes)):
        raise WeightUpdateError("serialized_named_tensors must be a non-empty list of base64 strings")
    if load_format not in (None, "direct", "flattened_bucket"):
        raise WeightUpdateError(f"unsupported load_format {load_format!r}: use null, 'direct' or 'flattened_bucket'")
    try:
        obj = weight_wire.deserialize(serialized[0])
    except ValueError as exc:
        raise WeightUpdateError(str(exc)) from exc
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or set(obj) < {"flattened_tensor", "metadata"}:
            raise WeightUpdateError("flattened_bucket payload must be a dict with flattened_tensor and metadata")
        try:
            return weight_wire.unflatten_bucket(obj["flattened_tensor"], obj["metadata"])
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
    return named


def check(runner: ModelRunner, named: NamedTensors) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Match each name to a parameter and check shapes; WeightUpdateError lists every problem."""
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
def apply(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> int:
    """Copy validated tensors into the parameters; waits for the copies (CUDA IPC senders free after reply)."""
    for param, tensor in pairs:
        param.copy_(tensor)
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
