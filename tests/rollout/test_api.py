"""The run API: HTTP (FastAPI) and gRPC Rollout, over one RunManager and the fake stack."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from services.common.grpc_server import ServiceServer, channel
from services.common.proto.rlyard.v1 import rollout_pb2, rollout_pb2_grpc
from services.rollout.grpc_api import RolloutServicer
from services.rollout.http_api import create_app
from services.rollout.manager import RunManager
from services.rollout.runner import Endpoints

RUN = {"tasks": ["python_product", "kernel_name_lower"], "steps": 2, "prompts_per_step": 2, "group_size": 2,
       "sampling": {"max_new_tokens": 48}, "episode": {"max_turns": 2}, "eval": {"every": 0}}


@pytest.fixture
async def api(fake_stack, tmp_path):
    mgr = RunManager(str(tmp_path / "runs"), Endpoints(fake_stack.engine_url, fake_stack.trainer_addr,
                                                       fake_stack.sandbox_addr))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(mgr)), base_url="http://rollout")
    yield mgr, client
    await client.aclose()
    await mgr.shutdown(grace=1)


async def _finish(mgr, run_id):
    live = mgr._live.get(run_id)
    if live:
        await asyncio.wait_for(live.task, 60)


async def test_http_run_lifecycle(api):
    mgr, http = api
    r = await http.post("/runs", json=RUN, params={"name": "demo"})
    assert r.status_code == 201, r.text
    run_id = r.json()["run_id"]
    assert r.json()["name"] == "demo" and r.json()["total_steps"] == 2
    await _finish(mgr, run_id)
    got = (await http.get(f"/runs/{run_id}")).json()
    assert got["state"] == "succeeded" and got["step"] == 2 and got["config"]["group_size"] == 2
    assert [r["run_id"] for r in (await http.get("/runs")).json()] == [run_id]
    assert (await http.get("/runs", params={"state": "failed"})).json() == []
    metrics = (await http.get(f"/runs/{run_id}/metrics")).json()
    assert [s["step"] for s in metrics["steps"]] == [1, 2] and metrics["steps"][0]["tokens_trained"] > 0
    # SSE replays a finished run: its state, then every step.
    body = (await http.get(f"/runs/{run_id}/events")).text
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "state" and [e["step"] for e in events if e["type"] == "step"] == [1, 2]
    assert "event: step" in body
    page = await http.get(f"/runs/{run_id}/report/index.html")
    assert page.status_code == 200 and "reward.png" in page.text
    assert (await http.get(f"/runs/{run_id}/report/..%2Fconfig.json")).status_code == 404
    prom = (await http.get("/metrics")).text
    assert f'rlyard_rollout_steps_total{{run="{run_id}"}} 2.0' in prom
    assert (await http.get("/health")).json()["status"] == "ok"
    assert (await http.delete(f"/runs/{run_id}")).json()["state"] == "succeeded"


async def test_http_rejects_bad_input_with_reasons(api):
    _, http = api
    r = await http.post("/runs", json={**RUN, "group_sise": 4})
    assert r.status_code == 422 and "group_sise" in r.text
    r = await http.post("/runs", json={**RUN, "sampling": {"temperature": -1}})
    assert r.status_code == 422 and "temperature" in r.text
    r = await http.post("/runs", json={**RUN, "tasks": ["no_such_task"]})
    assert r.status_code == 422 and "no_such_task" in r.text
    assert (await http.get("/runs/nope")).status_code == 404
    assert (await http.delete("/runs/nope")).status_code == 404
    assert (await http.get("/runs", params={"state": "sleeping"})).status_code == 422
    assert (await http.get("/openapi.json")).json()["paths"]["/runs"]["post"]


async def test_http_events_stream_live_steps(api):
    mgr, http = api
    run_id = (await http.post("/runs", json={**RUN, "steps": 3})).json()["run_id"]
    kinds = []
    async with http.stream("GET", f"/runs/{run_id}/events") as resp:
        async for line in resp.aiter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
    assert kinds.count("step") == 3 and "progress" in kinds and kinds[-1] == "state"


async def test_grpc_api(api):
    mgr, _ = api
    server = ServiceServer("127.0.0.1", 0)
    server.add(rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(mgr),
               rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name)
    port = await server.start()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)
            yaml_text = "steps: 2\ntasks: [python_product, kernel_name_lower]\nprompts_per_step: 2\n" \
                        "group_size: 2\neval: {every: 0}\nepisode: {max_turns: 2}\n"
            info = await stub.StartRun(rollout_pb2.StartRunRequest(config=yaml_text, name="g"))
            assert info.total_steps == 2 and json.loads(info.config_json)["group_size"] == 2
            kinds, steps, last = [], [], None
            async for ev in stub.WatchRun(rollout_pb2.RunRef(run_id=info.run_id)):
                kinds.append(ev.WhichOneof("event"))
                if ev.HasField("step"):
                    steps.append(ev.step.step)
                    assert ev.step.metrics["tokens_trained"] > 0
                if ev.HasField("state"):
                    last = ev.state
            assert steps == [1, 2] and "progress" in kinds
            assert last.state == rollout_pb2.RUN_STATE_SUCCEEDED
            got = await stub.GetRun(rollout_pb2.RunRef(run_id=info.run_id))
            assert got.step == 2 and got.last_metrics["reward_mean"] == pytest.approx(got.last_metrics["reward_mean"])
            listed = await stub.ListRuns(rollout_pb2.ListRunsRequest(states=[rollout_pb2.RUN_STATE_SUCCEEDED]))
            assert [r.run_id for r in listed.runs] == [info.run_id]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.StartRun(rollout_pb2.StartRunRequest(config='{"group_sise": 2}'))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "group_sise" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetRun(rollout_pb2.RunRef(run_id="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.StopRun(rollout_pb2.RunRef())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0)
