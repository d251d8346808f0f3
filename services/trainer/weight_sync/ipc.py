"""Same-host weight push by handle: CUDA IPC across GPUs, shared memory on the CPU.

GPU path, per bucket: the flat bucket (a slice of the ParamArena when the
parameters live in one, else one concatenation kernel), ONE copy of it into a
staging buffer on the engine's GPU (peer-to-peer when the cards allow it,
otherwise through pinned host memory), then the CUDA-IPC handle of that
buffer (with the GPU's UUID, see weight_wire) goes to
POST /update_weights_from_tensor as a "flattened_bucket" at once: the IPC
event in the pickle marks the end of the copy, and the engine queues its load
behind it, so decoding the request overlaps the copy. The copy of bucket
k+1 is queued as soon as the engine has finished with bucket k-1 (whose
staging slot it reuses), so it runs while the engine loads bucket k. Staging buffers
outlive the sync (`StagingBuffers`), so the engine receives the same handles
each time and need not open them again.

CPU path: the bucket is copied straight into a shared-memory segment
(file_system sharing strategy), whose name is all the pickle carries; the
engine maps it by name.

`flatten`/`copy` timings on the GPU are device times from CUDA events (they
overlap the engine's load, so the phases can add up to more than `total`).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

import torch

from services.common import weight_wire
from services.common.sglang_client import SGLangClient
from services.trainer.param_arena import ParamArena
from services.trainer.weight_sync.buckets import FlattenCache, plan_buckets, shared_tensor
from services.trainer.weight_sync.timing import PhaseTimer


async def _post_all(clients: Sequence[SGLangClient], payload: str, last: bool, flush_cache: bool,
                    weight_version: str | None, timer: PhaseTimer) -> None:
    t0 = time.perf_counter()
    for c in clients:
        await c.update_weights_from_tensor([payload], load_format="flattened_bucket",
                                           flush_cache=flush_cache and last,
                                           weight_version=weight_version if last else None)
    timer.add("engine_load", (time.perf_counter() - t0) * 1e3)


class StagingBuffers:
    """Receive buffers on the engine's GPU that live as long as the syncer and serve every sync.

    Bucket k lands in slot k % 2, so bucket k+1 can be copied while the engine
    loads bucket k. Reusing the same allocations means the engine is sent the
    same CUDA-IPC handles every time and can keep them open (services.engine
    caches its most recent mappings): opening a handle costs milliseconds.
    The price is up to two buckets of memory held on the engine's card.
    """

    def __init__(self, max_uses: int = 1000) -> None:
        self._bufs: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._uses: dict[tuple[torch.device, int], int] = {}
        # PyTorch keeps a small record (an event, a ref-counter slot) per share of a buffer until the
        # buffer is freed: a fresh allocation every `max_uses` shares bounds them.
        self.max_uses = max_uses

    def get(self, device: torch.device, slot: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of `nbytes` at offset 0 of the slot's buffer (grown when too small)."""
        key = (device, slot)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes or self._uses.get(key, 0) >= self.max_uses:
            self._bufs.pop(key, None)
            buf = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._uses[key] = 0
        self._uses[key] += 1
        return buf[:nbytes]

    def clear(self) -> None:
        self._bufs.clear()
        self._uses.clear()


BucketSource = Callable[[int], tuple[torch.Tensor, list]]


def bucket_source(named: Sequence[tuple[str, torch.Tensor]], buckets: list[list[int]], layout: str,
                  cache: FlattenCache, arena: ParamArena | None, shared: bool = False) -> BucketSource:
    """k -> (flat tensor, metadata) of bucket k: a slice of the arena when the parameters live in one
    (no copy), else a concatenation (FlattenCache)."""
    if arena is not None:
        views = arena.buckets(buckets, layout)
        if not shared:
            return lambda k: views[k]

        def to_shared(k: int) -> tuple[torch.Tensor, list]:
            flat, meta = views[k]
            return shared_tensor(flat.numel(), flat.dtype).copy_(flat), meta
        return to_shared
    return lambda k: cache.flatten([named[i] for i in buckets[k]], layout, shared=shared)


async def push_ipc(named: Sequence[tuple[str, torch.Tensor]], clients: Sequence[SGLangClient], *,
                   cap_bytes: int, engine_device: torch.device | None, layout: str,
                   weight_version: str | None, flush_cache: bool, timer: PhaseTimer,
                   cache: FlattenCache | None = None, arena: ParamArena | None = None,
                   staging: StagingBuffers | None = None) -> int:
    """Push `named` tensors to every client; return the number of buckets.

    `arena`: the parameters' ParamArena when `named` is its `named_tensors()`; `staging`: receive
    buffers kept between syncs (a fresh set per call when None).
    """
    buckets = plan_buckets(named, cap_bytes)
    src = named[0][1].device
    cuda = src.type == "cuda"
    source = bucket_source(named, buckets, layout, cache or FlattenCache(), arena, shared=not cuda)
    if cuda:
        await _push_cuda(source, len(buckets), clients, src, engine_device or src,
                         weight_version, flush_cache, timer, staging or StagingBuffers())
    else:
        await _push_cpu(source, len(buckets), clients, weight_version, flush_cache, timer)
    return len(buckets)


async def _push_cpu(source: BucketSource, n: int, clients, weight_version, flush_cache, timer) -> None:
    weight_wire.use_cpu_shared_memory()
    for k in range(n):
        with timer.phase("flatten"):  # straight into shared memory: pickling then copies nothing
            flat, meta = source(k)
        with timer.phase("serialise"):
            payload = weight_wire.serialize(weight_wire.bucket_payload(flat, meta))
        await _post_all(clients, payload, k == n - 1, flush_cache, weight_version, timer)
        del flat  # the engine has replied: the shared segment may go


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device for the whole process: the caching allocator keeps blocks
    per stream, so a fresh stream per sync would strand cached buffers."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


async def _push_cuda(source: BucketSource, n: int, clients, src: torch.device, dst: torch.device,
                     weight_version, flush_cache, timer, staging: StagingBuffers) -> None:
    weight_wire.enable_cuda_uuid_mapping()
    same = src == dst
    peer = same or torch.cuda.can_device_access_peer(src, dst)
    stream = _side_stream(src)
    stream.wait_stream(torch.cuda.current_stream(src))  # weights are final before we read them
    events: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event | None]] = []

    dst_stream = None if peer else _side_stream(dst)

    def launch(k: int):
        with torch.cuda.stream(stream):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record(stream)
            flat, meta = source(k)
            e1.record(stream)
            if same:
                out = flat
            else:
                out = staging.get(dst, k % 2, flat.numel() * flat.element_size()).view(flat.dtype)
                if peer:
                    out.copy_(flat, non_blocking=True)  # runs on `stream`, the source device's current stream
                else:
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    dst_stream.wait_stream(stream)
                    with torch.cuda.stream(dst_stream):
                        out.copy_(host, non_blocking=True)
                    flat = (flat, host)  # both stay alive until the engine replied
            e2.record(stream)
        # The CUDA-IPC event that pickling records goes on the engine card's current stream: make that
        # stream wait for the flatten and the copy, so the engine, which queues its load behind the
        # event, never reads the buffer early. The POST can then leave before the copy has landed.
        torch.cuda.current_stream(dst).wait_stream(stream if peer else dst_stream)
        if not peer:
            e2 = None  # device times across two GPUs are not comparable
        events.append((e0, e1, e2))
        return out, meta, flat

    pending: asyncio.Task | None = None
    in_flight: list = []  # buffers the engine may still be reading
    nxt = launch(0)
    try:
        for k in range(n):
            out, meta, flat = nxt
            in_flight.append((out, flat))
            with timer.phase("serialise"):  # after the copy is queued: the shared event covers it
                payload = weight_wire.serialize(weight_wire.bucket_payload(out, meta))
            if pending is not None:
                await pending  # the engine is done with bucket k-1: its staging slot is free
                in_flight.pop(0)
            if k + 1 < n:
                nxt = launch(k + 1)  # queued right behind copy k: the link never idles
            pending = asyncio.ensure_future(_post_all(clients, payload, k == n - 1,
                                                      flush_cache, weight_version, timer))
        if pending is not None:
            await pending
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        in_flight.clear()
        nxt = None
        with timer.phase("finish"):
            torch.cuda.synchronize(src)
            torch.cuda.ipc_collect()
    for e0, e1, e2 in events:
        timer.add("flatten", e0.elapsed_time(e1))
        if e2 is not None:
            timer.add("copy", e1.elapsed_time(e2))
