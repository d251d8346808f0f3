"""Scheduling control on the real engine: abort, pause (abort/retract/in_place), continue, flush, update atomicity."""
import asyncio
import time

import httpx
import pytest
import torch

from services.common import weight_wire as ww
from services.common.sglang_client import EngineError

LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


async def _until_running(client, n=1, timeout=120):
    deadline = time.monotonic() + timeout
    while (await client.server_info())["internal_states"][0]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "request never started"
        await asyncio.sleep(0.05)


async def test_abort_request_by_rid(client, prompt):
    task = asyncio.create_task(client.generate(prompt, LONG, rid="victim"))
    await _until_running(client)
    await client.abort_request(rid="victim")
    reply = await asyncio.wait_for(task, 300)
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < reply["meta_info"]["completion_tokens"] < 400
    with pytest.raises(EngineError) as err:
        await client.abort_request()
    assert err.value.status == 400


async def test_pause_abort_then_continue(client, prompt):
    task = asyncio.create_task(client.generate(prompt, LONG))
    await _until_running(client)
    await client.pause_generation("abort")
    assert (await asyncio.wait_for(task, 300))["meta_info"]["finish_reason"]["type"] == "abort"
    waiting = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 2, "temperature": 0}))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # paused: new requests wait
    await client.continue_generation()
    assert (await asyncio.wait_for(waiting, 300))["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_keeps_requests_and_resumes_them(client, prompt, mode):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    solo = await client.generate(prompt, params)
    task = asyncio.create_task(client.generate(prompt, params))
    await _until_running(client)
    await client.pause_generation(mode)
    await asyncio.sleep(0.3)
    assert not task.done()
    await client.continue_generation()
    reply = await asyncio.wait_for(task, 300)
    assert reply["output_ids"] == solo["output_ids"]
    assert reply["meta_info"]["finish_reason"]["type"] == "length"


async def test_bad_pause_mode(engine_url):
    async with httpx.AsyncClient(base_url=engine_url) as http:
        resp = await http.post("/pause_generation", json={"mode": "sideways"})
        assert resp.status_code == 400 and "pause mode" in resp.json()["error"]["message"]


async def test_flush_cache(client, engine_url, prompt):
    await client.flush_cache()
    task = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}))
    await _until_running(client)
    async with httpx.AsyncClient(base_url=engine_url) as http:
        assert (await http.post("/flush_cache")).status_code == 400  # requests running, as SGLang answers
    await client.flush_cache()  # retried until the request finished
    assert task.done()


async def test_update_waits_for_running_requests(client, checkpoint, prompt):
    """No request sees two weight versions: the update lands after the running request finished."""
    ww.use_cpu_shared_memory()
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    solo = await client.generate(prompt, params)
    version = (await client.model_info())["weight_version"]
    running = asyncio.create_task(client.generate(prompt, params))
    await _until_running(client)
    named = [(k, torch.zeros_like(v)) for k, v in checkpoint.items() if k.endswith("norm.weight")]
    named_back = [(k, checkpoint[k]) for k, _ in named]
    update = asyncio.create_task(client.update_weights_from_tensor([ww.serialize(named)], weight_version="zeroed"))
    reply = await asyncio.wait_for(running, 300)
    await asyncio.wait_for(update, 300)
    assert reply["output_ids"] == solo["output_ids"] and reply["meta_info"]["weight_version"] == version
    zeroed = await client.generate(prompt, {"max_new_tokens": 4, "temperature": 0})
    assert zeroed["meta_info"]["weight_version"] == "zeroed" and zeroed["output_ids"] != solo["output_ids"][:4]
    await client.update_weights_from_tensor([ww.serialize(named_back)], weight_version=version)
    assert (await client.generate(prompt, params))["output_ids"] == solo["output_ids"]


async def test_update_while_paused_applies_at_once(client, checkpoint, prompt):
    ww.use_cpu_shared_memory()
    await client.pause_generation("in_place")
    try:
        reply = await asyncio.wait_for(client.update_weights_from_tensor(
            [ww.serialize([("model.norm.weight", checkpoint["model.norm.weight"])])], weight_version="while-paused"), 300)
        assert reply["success"]
    finally:
        await client.continue_generation()
    assert (await client.generate(prompt, {"max_new_tokens": 1}))["meta_info"]["weight_version"] == "while-paused"
