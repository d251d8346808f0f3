"""Group named tensors into buckets: one dtype per bucket, at most `cap_bytes` each.

One dtype per bucket keeps every tensor's byte offset aligned, so the same
bucket is valid in SGLang's "bytes" layout (0.5.23) and "elements" layout
(0.5.16). A tensor larger than the cap gets a bucket of its own.
"""
from __future__ import annotations

from typing import Sequence

import torch


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], cap_bytes: int) -> list[list[int]]:
    """Indices of `named`, grouped into buckets; the model's order is kept inside each dtype."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_dtype.setdefault(t.dtype, []).append(i)
    buckets: list[list[int]] = []
    for indices in by_dtype.values():
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = named[i][1].numel() * named[i][1].element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Total bytes of the tensors."""
    return sum(t.numel() * t.element_size() for _, t in named)


class FlattenCache:
    """Remembers each bucket's flat views and metadata between syncs of the same tensors.

    Parameters keep their storage between optimiser steps, so the per-tensor
    Python work of `weight_wire.flatten_bucket` (views, metadata objects) is
    done once; later syncs only launch one concatenation into a fresh buffer.
    Any change of a tensor's storage, shape or dtype misses the cache.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[list[torch.Tensor], list]] = {}

    def flatten(self, part: Sequence[tuple[str, torch.Tensor]], layout: str,
                shared: bool = False) -> tuple[torch.Tensor, list]:
        """(flat tensor, metadata) of `part`. `shared` (CPU only): build the flat tensor directly
        in shared memory, so that pickling it for the engine copies nothing more."""
        from services.common import weight_wire
        key = (layout, *((n, t.data_ptr(), t.dtype, tuple(t.shape), t.is_contiguous()) for n, t in part))
        hit = self._entries.get(key)
        if hit is None:
            flat, meta = weight_wire.flatten_bucket(list(part), layout=layout)
            if shared:
                flat.share_memory_()
            if all(t.is_contiguous() for _, t in part):
                views = [t.detach().reshape(-1) for _, t in part]
                if layout == "bytes":
                    views = [v.view(torch.uint8) for v in views]
                if len(self._entries) > 4096:  # a model rebuilt many times: start over
                    self._entries.clear()
                self._entries[key] = (views, meta)
            return flat, meta
        views, meta = hit
        if not shared:
            return torch.cat(views), meta
        return torch.cat(views, out=shared_tensor(sum(v.numel() for v in views), views[0].dtype)), meta


def shared_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor in a shared-memory segment (pickled by the segment's name)."""
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,))
