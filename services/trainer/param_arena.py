"""Keep a model's parameters back to back in one flat buffer per dtype, so a weight sync copies nothing twice.

`ParamArena.pack(model)` moves every parameter (tied ones once) into a flat
buffer of its dtype, in model order, and points `param.data` at its slice.
Optimiser steps and checkpoint loads write parameters in place, so they stay
there. A weight-sync bucket (tensors of one dtype, consecutive in model order,
see `weight_sync.buckets.plan_buckets`) is then a plain slice of the arena:
no concatenation and no per-tensor work on each sync, only one copy of that
slice to the engine's card.

Anything that re-allocates a parameter (`model.to(...)`, assigning `.data`)
takes it out of the arena; `intact()` notices and the sync falls back to
flattening.
"""
from __future__ import annotations

import types
from typing import Sequence

import torch
from torch import nn

from services.common import weight_wire


class ParamArena:
    """Flat per-dtype storage behind a model's parameters, and its buckets for weight sync."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], flats: dict[torch.dtype, torch.Tensor]) -> None:
        self.named = named
        self.flats = flats
        self._ptrs = [p.data_ptr() for _, p in named]
        self._detached = [(n, p.detach()) for n, p in named]  # alias the arena for as long as it is intact
        self._buckets: dict[tuple, list[tuple[torch.Tensor, list[types.SimpleNamespace]]]] = {}

    @classmethod
    def pack(cls, model: nn.Module) -> "ParamArena":
        """Move `model`'s parameters into per-dtype arenas (one dtype at a time, to bound the peak)."""
        named = [(n, p) for n, p in model.named_parameters()]
        if not named:
            raise ValueError("the model has no parameters")
        if any(hasattr(p, "to_local") for _, p in named):
            raise ValueError("sharded (DTensor) parameters cannot be packed: FSDP owns their storage")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"parameters span several devices {sorted(map(str, devices))}")
        flats: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dict.fromkeys(p.dtype for _, p in named):
            group = [p for _, p in named if p.dtype == dtype]
            flat = torch.empty(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            offset = 0
            with torch.no_grad():
                for p in group:
                    n = p.numel()
                    flat[offset:offset + n].copy_(p.data.reshape(-1))
                    p.data = flat[offset:offset + n].view(p.shape)
                    offset += n
            flats[dtype] = flat
        return cls(named, flats)

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())

    def intact(self) -> bool:
        """True while every parameter still lives where `pack` put it."""
        return all(p.data_ptr() == ptr for (_, p), ptr in zip(self.named, self._ptrs))

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, detached parameter) in model order: what a weight sync sends."""
        return list(self._detached)

    def buckets(self, plan: Sequence[Sequence[int]], layout: str) -> list[tuple[torch.Tensor, list]]:
        """For each bucket of indices (from plan_buckets over `named_tensors()`): its flat slice and metadata.

        Cached per plan and layout; the slices alias the parameters, so they always hold the
        current weights. "bytes" gives uint8 slices, "elements" slices of the bucket's dtype.
        """
        key = (tuple(map(tuple, plan)), layout)
        if key not in self._buckets:
            out = []
            for idx in plan:
                part = [self._detached[i] for i in idx]
                meta = weight_wire.bucket_metadata(part, layout)
                first = part[0][1]
                flat = self.flats[first.dtype]
                start = (first.data_ptr() - flat.data_ptr()) // first.element_size()
                stop = start + sum(t.numel() for _, t in part)
                view = flat[start:stop]
                for (_, t), m in zip(part, meta):  # the plan must follow arena order exactly
                    expect = view.data_ptr() + (m.start_idx if layout == "bytes" else m.start_idx * t.element_size())
                    if t.data_ptr() != expect:
                        raise ValueError("bucket plan does not follow the arena's order")
                out.append((view.view(torch.uint8) if layout == "bytes" else view, meta))
            self._buckets[key] = out
        return self._buckets[key]
