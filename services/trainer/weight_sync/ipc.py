"""Same-host weight push by handle: CUDA IPC across GPUs, shared memory on the CPU.

GPU path, per bucket: flatten on the trainer's GPU (one kernel), ONE copy of
the flat buffer to the engine's GPU (peer-to-peer when the cards allow it,
otherwise staged through pinned host memory), then the CUDA-IPC handle of that
buffer (with the GPU's UUID, see weight_wire) goes to
POST /update_weights_from_tensor as a "flattened_bucket". Flatten and copy of
bucket k+1 run on a side stream while the engine loads bucket k. Every buffer
stays alive until the engine's reply, then `torch.cuda.ipc_collect()` lets the
allocator reuse them.

CPU path: the bucket is concatenated straight into a shared-memory segment
(file_system sharing strategy), whose name is all the pickle carries; the
engine maps it by name.

`flatten`/`copy` timings on the GPU are device times from CUDA events (they
overlap the engine's load, so the phases can add up to more than `total`).
"""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

import torch

from services.common import weight_wire
from services.common.sglang_client import SGLangClient
from services.trainer.weight_sync.buckets import FlattenCache, plan_buckets
from services.trainer.weight_sync.timing import PhaseTimer


async def _post_all(clients: Sequence[SGLangClient], payload: str, last: bool, flush_cache: bool,
                    weight_version: str | None, timer: PhaseTimer) -> None:
    t0 = time.perf_counter()
    for c in clients:
        await c.update_weights_from_tensor([payload], load_format="flattened_bucket",
                                           flush_cache=flush_cache and last,
                                           weight_version=weight_version if last else None)
    timer.add("engine_load", (time.perf_counter() - t0) * 1e3)


async def push_ipc(named: Sequence[tuple[str, torch.Tensor]], clients: Sequence[SGLangClient], *,
                   cap_bytes: int, engine_device: torch.device | None, layout: str,
                   weight_version: str | None, flush_cache: bool, timer: PhaseTimer,
                   cache: FlattenCache | None = None) -> int:
    """Push `named` tensors to every client; return the number of buckets."""
    buckets = plan_buckets(named, cap_bytes)
    src = named[0][1].device
    if src.type == "cuda":
        await _push_cuda(named, buckets, clients, src, engine_device or src, layout,
                         weight_version, flush_cache, timer, cache or FlattenCache())
    else:
        await _push_cpu(named, buckets, clients, layout, weight_version, flush_cache, timer,
                        cache or FlattenCache())
    return len(buckets)


async def _push_cpu(named, buckets, clients, layout, weight_version, flush_cache, timer,
                    cache: FlattenCache) -> None:
    weight_wire.use_cpu_shared_memory()
    for k, idx in enumerate(buckets):
        with timer.phase("flatten"):  # straight into shared memory: pickling then copies nothing
            flat, meta = cache.flatten([named[i] for i in idx], layout, shared=True)
        with timer.phase("serialise"):
            payload = weight_wire.serialize(weight_wire.bucket_payload(flat, meta))
        await _post_all(clients, payload, k == len(buckets) - 1, flush_cache, weight_version, timer)
        del flat  # the engine has replied: the shared segment may go


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device for the whole process: the caching allocator keeps blocks
    per stream, so a fresh stream per sync would strand cached buffers."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


async def _push_cuda(named, buckets, clients, src: torch.device, dst: torch.device, layout,
                     weight_version, flush_cache, timer, cache: FlattenCache) -> None:
    weight_wire.enable_cuda_uuid_mapping()
    same = src == dst
    peer = same or torch.cuda.can_device_access_peer(src, dst)
    stream = _side_stream(src)
    stream.wait_stream(torch.cuda.current_stream(src))  # weights are final before we read them
    events: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event | None]] = []

    dst_stream = None if peer else _side_stream(dst)

    def launch(idx: list[int]):
        with torch.cuda.stream(stream):
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record(stream)
            flat, meta = cache.flatten([named[i] for i in idx], layout)
            e1.record(stream)
            if same:
                out = flat
            elif peer:
                out = torch.empty_like(flat, device=dst)
                out.copy_(flat, non_blocking=True)  # runs on `stream`, the source device's current stream
            else:
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                dst_stream.wait_stream(stream)
                with torch.cuda.stream(dst_stream):
                    out = torch.empty_like(flat, device=dst)
                    out.copy_(host, non_blocking=True)
                flat = (flat, host)  # both stay alive until the engine replied
            e2.record(stream)
        done = e2
        if not peer:
            done = torch.cuda.Event()
            done.record(dst_stream)
            e2 = None  # device times across two GPUs are not comparable: copy_wait covers it
        events.append((e0, e1, e2))
        return out, meta, flat, done

    pending: asyncio.Task | None = None
    in_flight: list = []  # buffers the engine may still be reading
    nxt = launch(buckets[0])
    try:
        for k in range(len(buckets)):
            out, meta, flat, done = nxt
            t0 = time.perf_counter()
            while not done.query():  # yield, so the POST of the previous bucket keeps moving
                await asyncio.sleep(0)
            timer.add("copy_wait", (time.perf_counter() - t0) * 1e3)
            with timer.phase("serialise"):
                payload = weight_wire.serialize(weight_wire.bucket_payload(out, meta))
            if pending is not None:
                await pending
                in_flight.pop(0)
            in_flight.append((out, flat))
            pending = asyncio.ensure_future(_post_all(clients, payload, k == len(buckets) - 1,
                                                      flush_cache, weight_version, timer))
            if k + 1 < len(buckets):
                nxt = launch(buckets[k + 1])  # overlaps the engine's load of bucket k
        if pending is not None:
            await pending
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        in_flight.clear()
        nxt = None
        torch.cuda.synchronize(src)
        torch.cuda.ipc_collect()
    for e0, e1, e2 in events:
        timer.add("flatten", e0.elapsed_time(e1))
        if e2 is not None:
            timer.add("copy", e1.elapsed_time(e2))
