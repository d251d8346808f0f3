"""Cross-host weight push by collective broadcast (SGLang's distributed update).

The trainer is rank 0 of a dedicated process group; each engine joins at
`rank_offset` through POST /init_weights_update_group, which blocks until every
rank is in, so the HTTP call and the trainer's own join run concurrently. The
group is built the way SGLang builds its side (weight_wire.join_weight_update_group:
TCP rendezvous, a PrefixStore named after the group, a non-default process
group), so the two meet. Per bucket the trainer announces names/dtypes/shapes
with POST /update_weights_from_distributed and, while the request is in
flight, broadcasts either one flattened uint8 bucket (load_format
"flattened_bucket", one collective per bucket) or the tensors one by one in
that order (SGLang 0.5.16). Backend "nccl" on GPUs, "gloo" on CPUs.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import torch
import torch.distributed as dist

from services.common import weight_wire
from services.common.sglang_client import SGLangClient
from services.trainer.weight_sync.buckets import plan_buckets
from services.trainer.weight_sync.timing import PhaseTimer

log = logging.getLogger(__name__)


class NcclChannel:
    """An open weight-update group between this trainer and some engines."""

    def __init__(self, clients: Sequence[SGLangClient], master_address: str, master_port: int,
                 backend: str, group_name: str = "rlyard_weights", flattened: bool = True) -> None:
        self.clients = list(clients)
        self.flattened = flattened
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name = backend, group_name
        self.group = None

    async def open(self) -> None:
        world = 1 + len(self.clients)
        calls = [c.init_weights_update_group(self.master_address, self.master_port, rank_offset=1 + i,
                                             world_size=world, group_name=self.group_name,
                                             backend=self.backend)
                 for i, c in enumerate(self.clients)]
        joined = asyncio.to_thread(weight_wire.join_weight_update_group, self.master_address,
                                   self.master_port, 0, world, self.group_name, self.backend)
        results = await asyncio.gather(joined, *calls)
        self.group = results[0]

    async def close(self) -> None:
        """Leave the group on both sides at once: NCCL teardown waits for the peers."""
        if self.group is None:
            return
        group, self.group = self.group, None
        results = await asyncio.gather(asyncio.to_thread(dist.destroy_process_group, group),
                                       *(c.destroy_weights_update_group(self.group_name) for c in self.clients),
                                       return_exceptions=True)
        for who, res in zip(["trainer", *(c.base_url for c in self.clients)], results):
            if isinstance(res, Exception):  # an engine may be gone already; the group dies with it
                log.warning("leaving weight-update group %s (%s): %s", self.group_name, who, res)

    async def push(self, named: Sequence[tuple[str, torch.Tensor]], *, cap_bytes: int,
                   weight_version: str | None, flush_cache: bool, timer: PhaseTimer) -> int:
        """Broadcast `named` bucket by bucket; return the number of buckets."""
        if self.group is None:
            await self.open()
        buckets = plan_buckets(named, cap_bytes)
        for k, idx in enumerate(buckets):
            last = k == len(buckets) - 1
            part = [named[i] for i in idx]
            calls = [c.update_weights_from_distributed(
                [n for n, _ in part], [str(t.dtype).removeprefix("torch.") for _, t in part],
                [list(t.shape) for _, t in part], group_name=self.group_name,
                flush_cache=flush_cache and last, weight_version=weight_version if last else None,
                load_format="flattened_bucket" if self.flattened else None)
                for c in self.clients]
            with timer.phase("engine_load"):
                await asyncio.gather(asyncio.to_thread(self._broadcast, part), *calls)
        return len(buckets)

    def _broadcast(self, part: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.flattened:
            flat, _ = weight_wire.flatten_bucket(list(part), layout="bytes")
            dist.broadcast(flat, src=0, group=self.group)
        else:
            for _, t in part:
                dist.broadcast(t.contiguous(), src=0, group=self.group)
        if part and part[0][1].is_cuda:
            torch.cuda.synchronize(part[0][1].device)
