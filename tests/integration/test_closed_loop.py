"""The closed loop through all four services as real processes: rollout ↔ engine ↔ sandbox, trainer step, weight sync.

Runs a short sync run and a short async run (two steps each) against one
stack started with the same launcher `make run` uses, then checks what each
service saw: trained tokens, weight syncs that changed the engine's
weight_version, episodes played in sandboxes, and gRPC health of every service.
"""
import asyncio

import httpx
import pytest

from services.common.grpc_server import check_health
from services.common.proto.rlyard.v1 import rollout_pb2
from services.launch.watch import follow, start_run

pytestmark = pytest.mark.slow

RUN = {
    "tasks": ["sha256_nano_miles", "kernel_name_lower"],
    "prompts_per_step": 2,
    "group_size": 2,
    "concurrency": 4,
    "min_ok_fraction": 0.5,
    "sampling": {"temperature": 1.0, "max_new_tokens": 48},
    "episode": {"max_turns": 2, "max_response_tokens": 256, "context_limit": 1024, "command_timeout_s": 10},
    "loss": {"lr": 1e-6},
    "eval": {"every": 0},
}


def _engine_version(url: str) -> str:
    info = httpx.get(f"{url}/model_info", timeout=10).json()
    return str(info.get("weight_version"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_steps_through_all_four_services(stack, mode):
    st, ep = stack
    before = _engine_version(ep.engine_url)
    run = start_run(ep.rollout_http, {**RUN, "mode": mode, "steps": 2}, name=f"it-{mode}")
    run_id = run.get("run_id") or run.get("id")
    info = asyncio.run(asyncio.wait_for(follow(ep.rollout_grpc, run_id), timeout=900))
    assert info.state == rollout_pb2.RUN_STATE_SUCCEEDED, info.message
    assert info.step == 2
    metrics = httpx.get(f"{ep.rollout_http}/runs/{run_id}/metrics", timeout=10).json()
    steps = metrics if isinstance(metrics, list) else metrics.get("steps", metrics.get("metrics", []))
    assert len(steps) >= 2
    trained = sum(float(s.get("tokens_trained", 0)) for s in steps)
    assert trained > 0, steps
    after = _engine_version(ep.engine_url)
    assert after != before, "the engine's weight_version did not change: no weight sync landed"
    for addr in (ep.sandbox_grpc, ep.trainer_grpc, ep.rollout_grpc):
        assert asyncio.run(check_health(addr)), addr
    assert not st.failed(), f"services exited: {st.failed()}"


def test_bad_run_config_is_rejected_with_the_field_named(stack):
    _, ep = stack
    reply = httpx.post(f"{ep.rollout_http}/runs", json={**RUN, "group_sise": 4}, timeout=10)
    assert reply.status_code == 422
    assert "group_sise" in reply.text
