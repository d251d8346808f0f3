"""The one async client rlyard uses for SGLang's native HTTP API (rlyard's engine, SGLang 0.5.16 and 0.5.23).

Pooled aiohttp connections (its C parser answers a localhost round trip in
~0.6 ms where httpx takes ~2 ms, which matters for a weight sync measured in
milliseconds), per-request timeouts, retries only where they are
safe (the connection was refused, so nothing reached the server; idempotent
GETs; the 400 that /flush_cache answers while requests still run). Every
failure is raised as EngineError carrying the HTTP status and the server's
reason. SGLang >= 0.5.23 wants tensor and distributed weight updates inside a
begin/end weight-update session; `weight_update_session()` opens one when the
server has the endpoint and is a no-op otherwise.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Any, AsyncIterator

import aiohttp

__all__ = ["EngineError", "SGLangClient"]

_SESSION_HINT = "begin_weight_update"  # 0.5.23's refusal outside a session names it


class EngineError(RuntimeError):
    """An engine call failed; `status` is the HTTP status (None: no reply), `body` the reply."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def _reason(body: Any) -> str:
    """Pull a readable reason out of SGLang's and FastAPI's error shapes."""
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            value = body.get(key)
            if isinstance(value, dict):
                return _reason(value)
            if isinstance(value, list):  # FastAPI validation errors
                return "; ".join(str(v.get("msg", v)) if isinstance(v, dict) else str(v) for v in value)
            if value:
                return str(value)
    return str(body)[:2000]


@dataclasses.dataclass
class Reply:
    """One HTTP reply: status and the body, parsed as JSON when it is JSON (else text)."""

    status_code: int
    body: Any


class SGLangClient:
    """Async client for one SGLang-compatible server at `base_url` (e.g. http://127.0.0.1:30000)."""

    def __init__(self, base_url: str, timeout: float = 120.0, connect_retries: int = 5) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_retries = connect_retries
        self._http: aiohttp.ClientSession | None = None  # made inside the event loop, on first use
        self._has_session_api: bool | None = None  # unknown until probed
        self._session_depth = 0
        self._session_lock = asyncio.Lock()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                # Idle connections are dropped well before uvicorn's 5 s keep-alive closes them from
                # the server side: a request sent on a connection the server is closing fails.
                connector=aiohttp.TCPConnector(limit=512, limit_per_host=512, keepalive_timeout=2.0),
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=min(self.timeout, 10.0)))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- transport -------------------------------------------------------------------------
    async def _request(self, method: str, path: str, payload: Any = None, timeout: float | None = None) -> Reply:
        kwargs: dict[str, Any] = {}
        if payload is not None:
            kwargs["data"] = json.dumps(payload)
            kwargs["headers"] = {"Content-Type": "application/json"}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, 10.0))
        async with self._session().request(method, self.base_url + path, **kwargs) as resp:
            raw = await resp.read()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        return Reply(resp.status, body)

    async def _send(self, method: str, path: str, payload: Any = None, *, timeout: float | None = None,
                    idempotent: bool = False) -> Reply:
        attempts = self.connect_retries + 1
        delay = 0.2
        for attempt in range(attempts):
            try:
                return await self._request(method, path, payload, timeout)
            except aiohttp.ClientConnectorError as exc:
                # Nothing reached the server: always safe to try again.
                error: Exception = exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
                if not idempotent:
                    raise EngineError(f"{method} {path}: connection lost: {exc}") from exc
                error = exc
            except asyncio.TimeoutError as exc:
                raise EngineError(f"{method} {path}: no reply within {timeout or self.timeout:.0f}s") from exc
            if attempt + 1 < attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise EngineError(f"{method} {path}: cannot reach {self.base_url}: {error}") from error

    async def _call(self, method: str, path: str, payload: Any = None, *, idempotent: bool = False,
                    timeout: float | None = None) -> Any:
        resp = await self._send(method, path, payload, idempotent=idempotent, timeout=timeout)
        body = resp.body
        if resp.status_code >= 400:
            raise EngineError(f"{method} {path} -> {resp.status_code}: {_reason(body)}", resp.status_code, body)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{method} {path} failed: {_reason(body)}", resp.status_code, body)
        return body

    async def _get_either(self, new: str, old: str) -> dict:
        try:
            return await self._call("GET", new, idempotent=True)
        except EngineError as exc:
            if exc.status != 404:
                raise
        return await self._call("GET", old, idempotent=True)

    # ---- health and info -------------------------------------------------------------------
    async def health(self) -> bool:
        """True when GET /health answers 200."""
        try:
            resp = await self._send("GET", "/health", idempotent=True, timeout=min(self.timeout, 10.0))
        except EngineError:
            return False
        return resp.status_code == 200

    async def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll /health_generate (or /health on servers without it) until 200; 503 and refusals are waited out."""
        deadline = time.monotonic() + timeout
        path = "/health_generate"
        last = "no reply"
        while True:
            try:
                resp = await self._request("GET", path, timeout=min(max(deadline - time.monotonic(), 1.0), 30.0))
                if resp.status_code == 200:
                    return
                if resp.status_code == 404 and path != "/health":
                    path = "/health"
                    continue
                last = f"{path} -> {resp.status_code}: {_reason(resp.body)}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise EngineError(f"{self.base_url} not ready after {timeout:.0f}s ({last})")
            await asyncio.sleep(0.5)

    async def model_info(self) -> dict:
        """GET /model_info (older servers: /get_model_info): model_path, weight_version, ..."""
        return await self._get_either("/model_info", "/get_model_info")

    async def server_info(self) -> dict:
        """GET /server_info (older servers: /get_server_info)."""
        return await self._get_either("/server_info", "/get_server_info")

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict, *,
                       return_logprob: bool = False, logprob_start_len: int = -1,
                       rid: str | None = None) -> dict | list[dict]:
        """POST /generate with token ids; returns SGLang's reply as-is (a list for batched input)."""
        payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                                   "return_logprob": return_logprob, "logprob_start_len": logprob_start_len}
        if rid is not None:
            payload["rid"] = rid
        return await self._call("POST", "/generate", payload)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request by rid, or all of them."""
        await self._call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause the scheduler: mode "abort", "retract" or "in_place"."""
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self, retry_for: float = 120.0) -> None:
        """POST /flush_cache; SGLang answers 400 while requests run, so that case is retried for `retry_for` s."""
        deadline = time.monotonic() + retry_for
        while True:
            try:
                await self._call("POST", "/flush_cache")
                return
            except EngineError as exc:
                if exc.status != 400 or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.25)

    # ---- weight updates --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """Run the enclosed updates inside /begin_weight_update … /end_weight_update when the server has them."""
        async with self._session_lock:
            opened = await self._begin_session() if self._session_depth == 0 else False
            self._session_depth += 1  # nested sessions are covered by the outer one
        try:
            yield
        finally:
            async with self._session_lock:
                self._session_depth -= 1
                if opened:
                    await self._call("POST", "/end_weight_update", {})

    async def _begin_session(self) -> bool:
        if self._has_session_api is False:
            return False
        try:
            await self._call("POST", "/begin_weight_update", {"selector": "all"})
        except EngineError as exc:
            if exc.status in (404, 405):
                self._has_session_api = False  # 0.5.16 and older: no session needed
                return False
            if exc.status == 400 and "already open" in str(exc):
                # A session left open by a crashed caller: close it and start ours.
                await self._call("POST", "/end_weight_update", {})
                await self._call("POST", "/begin_weight_update", {"selector": "all"})
            else:
                raise
        self._has_session_api = True
        return True

    async def _update(self, path: str, payload: dict, timeout: float | None = None) -> dict:
        """POST a weight update; outside a session, retry inside one if the server demands it."""
        try:
            return await self._call("POST", path, payload, timeout=timeout)
        except EngineError as exc:
            if self._session_depth or exc.status != 400 or _SESSION_HINT not in str(exc):
                raise
        async with self.weight_update_session():
            return await self._call("POST", path, payload, timeout=timeout)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], *,
                                         load_format: str | None = None, flush_cache: bool = True,
                                         weight_version: str | None = None,
                                         abort_all_requests: bool = False) -> dict:
        """POST /update_weights_from_tensor with one weight_wire.serialize() string per TP rank.

        The sender must keep the tensors alive until this returns.
        """
        payload: dict[str, Any] = {"serialized_named_tensors": serialized_named_tensors,
                                   "load_format": load_format, "flush_cache": flush_cache,
                                   "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._update("/update_weights_from_tensor", payload)

    async def update_weights_from_disk(self, model_path: str, *, flush_cache: bool = True,
                                       weight_version: str | None = None) -> dict:
        """POST /update_weights_from_disk: reload weights from a HF folder."""
        payload: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_disk", payload)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        """POST /init_weights_update_group; the server joins the group, so the trainer must join concurrently."""
        return await self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], *,
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True, weight_version: str | None = None,
                                              load_format: str | None = None) -> dict:
        """POST /update_weights_from_distributed; the trainer then broadcasts from rank 0, in `names` order
        (load_format "flattened_bucket": one uint8 bucket in weight_wire's bytes layout)."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes,
                                   "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._update("/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})
