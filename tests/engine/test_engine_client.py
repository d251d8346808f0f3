"""SGLangClient contract: retries, fallbacks, session detection and errors, against small in-test fake servers.

The real-engine behaviour of the same client is covered by the other tests in this folder.
"""
import asyncio
import contextlib
from typing import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.common.net import free_port
from services.common.sglang_client import EngineError, SGLangClient


@contextlib.asynccontextmanager
async def _client(app: FastAPI, **kw) -> AsyncIterator[SGLangClient]:
    """A client of `app`, served for real by uvicorn on a free loopback port for the test's duration."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", **kw) as c:
            yield c
    finally:
        server.should_exit = True
        await task


def _fake(session: bool, calls: list, not_ready: int = 0, flush_busy: int = 0, old_info: bool = False) -> FastAPI:
    app = FastAPI()
    state = {"not_ready": not_ready, "flush_busy": flush_busy, "open": False}

    @app.get("/health_generate")
    async def health_generate():
        calls.append("health_generate")
        if state["not_ready"]:
            state["not_ready"] -= 1
            return Response(status_code=503)
        return Response(status_code=200)

    if session:
        @app.post("/begin_weight_update")
        async def begin():
            calls.append("begin")
            state["open"] = True
            return {"success": True, "message": "Success"}

        @app.post("/end_weight_update")
        async def end():
            calls.append("end")
            state["open"] = False
            return {"success": True, "message": "Success"}

    @app.post("/update_weights_from_tensor")
    async def update(request: Request):
        body = await request.json()
        calls.append(("update", body))
        if session and not state["open"]:
            return JSONResponse({"success": False, "message": "update_weights_from_tensor must run between "
                                 "begin_weight_update() and end_weight_update()"}, status_code=400)
        return {"success": True, "message": "ok"}

    @app.post("/flush_cache")
    async def flush():
        calls.append("flush")
        if state["flush_busy"]:
            state["flush_busy"] -= 1
            return JSONResponse({"error": {"message": "pending requests"}}, status_code=400)
        return Response("Cache flushed.")

    @app.get("/get_model_info" if old_info else "/model_info")
    async def info():
        return {"model_path": "m", "weight_version": "default"}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        calls.append(("generate", body))
        if body["input_ids"] == [0]:
            return JSONResponse({"error": {"message": "token id 0 is cursed"}}, status_code=400)
        return {"text": "", "output_ids": [5], "meta_info": {"id": body.get("rid")}}

    return app


async def test_wait_ready_rides_out_503():
    calls = []
    async with _client(_fake(False, calls, not_ready=2)) as c:
        await c.wait_ready(timeout=10)
    assert calls.count("health_generate") == 3


async def test_wait_ready_times_out_with_reason():
    async with _client(_fake(False, [], not_ready=10_000)) as c:
        with pytest.raises(EngineError, match="not ready"):
            await c.wait_ready(timeout=1)


async def test_session_is_opened_only_when_the_server_has_it():
    calls = []
    async with _client(_fake(True, calls)) as c:
        async with c.weight_update_session():
            await c.update_weights_from_tensor(["x"], load_format="direct", weight_version="v1")
    assert [k if isinstance(k, str) else k[0] for k in calls] == ["begin", "update", "end"]
    sent = calls[1][1]
    assert sent == {"serialized_named_tensors": ["x"], "load_format": "direct", "flush_cache": True,
                    "abort_all_requests": False, "weight_version": "v1"}
    calls.clear()
    async with _client(_fake(False, calls)) as c:  # 0.5.16: no session endpoints
        async with c.weight_update_session():
            await c.update_weights_from_tensor(["x"])
        async with c.weight_update_session():  # the probe result is cached
            pass
    assert [k if isinstance(k, str) else k[0] for k in calls] == ["update"]


async def test_update_outside_session_is_retried_inside_one():
    calls = []
    async with _client(_fake(True, calls)) as c:
        assert (await c.update_weights_from_tensor(["x"]))["success"]
    assert [k if isinstance(k, str) else k[0] for k in calls] == ["update", "begin", "update", "end"]


async def test_flush_cache_retries_while_busy():
    calls = []
    async with _client(_fake(False, calls, flush_busy=2)) as c:
        await c.flush_cache()
    assert calls.count("flush") == 3


async def test_model_info_falls_back_to_old_path():
    async with _client(_fake(False, [], old_info=True)) as c:
        assert (await c.model_info())["model_path"] == "m"


async def test_generate_sends_sglang_fields_and_raises_reason():
    calls = []
    async with _client(_fake(False, calls)) as c:
        reply = await c.generate([1, 2], {"max_new_tokens": 3}, return_logprob=True, logprob_start_len=0, rid="r1")
        assert reply["meta_info"]["id"] == "r1"
        assert calls[0][1] == {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3},
                               "return_logprob": True, "logprob_start_len": 0, "rid": "r1"}
        with pytest.raises(EngineError) as err:
            await c.generate([0], {})
    assert err.value.status == 400 and "cursed" in str(err.value) and err.value.body["error"]


async def test_unreachable_server_raises_after_retries():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with SGLangClient(f"http://127.0.0.1:{port}", connect_retries=2) as c:
        with pytest.raises(EngineError, match="cannot reach") as err:
            await c.generate([1], {})
        assert err.value.status is None
        assert not await c.health()
