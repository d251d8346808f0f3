"""Push the trainer's weights into inference engines: `ipc`, `nccl` or `disk`.

`WeightSyncer.sync` gathers the full weights (FSDP shards included), hands
them to one method and returns a `SyncReport` with the bytes moved and a
timing breakdown (gather, flatten, copy, serialise, engine_load, total). The
engines are reached only through services.common.sglang_client.
"""
from __future__ import annotations

import contextlib
import pathlib
import re
import tempfile
import time
from typing import AsyncIterator, Callable, Iterable, Sequence

import torch

from services.common.sglang_client import SGLangClient
from services.trainer.weight_sync.buckets import FlattenCache, nbytes
from services.trainer.weight_sync.disk import push_disk
from services.trainer.param_arena import ParamArena
from services.trainer.weight_sync.ipc import StagingBuffers, push_ipc
from services.trainer.weight_sync.nccl import NcclChannel
from services.trainer.weight_sync.timing import PHASES, PhaseTimer, SyncReport

METHODS = ("ipc", "nccl", "disk")
__all__ = ["METHODS", "SyncReport", "WeightSyncer"]


class WeightSyncer:
    """Holds engine clients (one per URL) and the settings of the sync methods."""

    def __init__(self, *, default_method: str = "ipc", bucket_mb: int = 2048,
                 engine_device: str | None = None, layout: str = "bytes",
                 disk_root: str | None = None, nccl_master: tuple[str, int] = ("127.0.0.1", 29600),
                 nccl_backend: str | None = None, sessions: str = "auto") -> None:
        if default_method not in METHODS:
            raise ValueError(f"unknown sync method {default_method!r}; use one of {METHODS}")
        self.default_method = default_method
        self.bucket_mb = bucket_mb
        self.engine_device = torch.device(engine_device) if engine_device else None
        self.layout = layout
        self.disk_root = pathlib.Path(disk_root or tempfile.mkdtemp(prefix="rlyard-sync-"))
        self.nccl_master = nccl_master
        self.nccl_backend = nccl_backend
        if sessions not in ("auto", "always"):
            raise ValueError(f"sessions must be 'auto' or 'always', got {sessions!r}")
        # "auto": no begin/end_weight_update round trips unless the server demands them (the
        # client then retries that call inside a session: SGLang >= 0.5.23); "always": one
        # session around the whole sync.
        self.sessions = sessions
        self._flatten_cache = FlattenCache()
        self._staging = StagingBuffers()
        self._clients: dict[str, SGLangClient] = {}
        self._nccl: dict[tuple[str, ...], NcclChannel] = {}

    def client(self, url: str) -> SGLangClient:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"engine url {url!r} must look like http://host:port")
        if url not in self._clients:
            self._clients[url] = SGLangClient(url)
        return self._clients[url]

    async def aclose(self) -> None:
        self._staging.clear()
        for ch in self._nccl.values():
            await ch.close()
        for c in self._clients.values():
            await c.aclose()

    async def sync(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], config,
                   engine_urls: Sequence[str], *, method: str = "", weight_version: str,
                   bucket_mb: int = 0, flush_cache: bool = True,
                   arena: ParamArena | None = None) -> SyncReport:
        """Push the tensors `weights()` yields to every engine in `engine_urls`.

        `arena`: the ParamArena the same weights live in; while it is intact, `ipc` sends its
        slices as buckets (no flatten) and `weights()` is not called.
        """
        method = method or self.default_method
        if method not in METHODS:
            raise ValueError(f"unknown sync method {method!r}; use one of {', '.join(METHODS)}")
        if not engine_urls:
            raise ValueError("engine_urls is empty: name at least one engine")
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", weight_version):
            raise ValueError(f"weight_version {weight_version!r}: use letters, digits and . _ : - (max 128)")
        clients = [self.client(u) for u in engine_urls]
        cap = (bucket_mb or self.bucket_mb) << 20
        timer = PhaseTimer()
        t0 = time.perf_counter()
        if arena is not None and not arena.intact():
            arena = None
        with timer.phase("gather"):
            named = arena.named_tensors() if arena is not None else list(weights())
        report = SyncReport(method=method, weight_version=weight_version, bytes=nbytes(named))
        if method == "ipc":
            async with _sessions(clients, self.sessions == "always"):
                report.buckets = await push_ipc(named, clients, cap_bytes=cap, engine_device=self._target(named),
                                                layout=self.layout, weight_version=weight_version,
                                                flush_cache=flush_cache, timer=timer, cache=self._flatten_cache,
                                                arena=arena, staging=self._staging)
        elif method == "disk":
            await push_disk(named, clients, config=config, root=self.disk_root,
                            weight_version=weight_version, flush_cache=flush_cache, timer=timer)
            report.buckets = 1
        else:
            key = tuple(engine_urls)
            if key not in self._nccl:
                backend = self.nccl_backend or ("nccl" if named[0][1].is_cuda else "gloo")
                self._nccl[key] = NcclChannel(clients, *self.nccl_master, backend=backend)
            async with _sessions(clients, self.sessions == "always"):
                report.buckets = await self._nccl[key].push(named, cap_bytes=cap, weight_version=weight_version,
                                                            flush_cache=flush_cache, timer=timer)
        timer.ms["total"] = (time.perf_counter() - t0) * 1e3
        report.timing = {k: round(v, 4) for k, v in timer.ms.items() if k in PHASES or v}
        return report

    def _target(self, named) -> torch.device | None:
        """The engine's GPU: the configured one, else the next GPU when there are two or more."""
        src = named[0][1].device
        if src.type != "cuda":
            return None
        if self.engine_device is not None:
            return self.engine_device
        n = torch.cuda.device_count()
        return torch.device("cuda", (src.index + 1) % n) if n > 1 else src


@contextlib.asynccontextmanager
async def _sessions(clients: Sequence[SGLangClient], enabled: bool) -> AsyncIterator[None]:
    """A weight-update session on every client (a no-op on servers without sessions)."""
    async with contextlib.AsyncExitStack() as stack:
        for c in clients if enabled else ():
            await stack.enter_async_context(c.weight_update_session())
        yield
