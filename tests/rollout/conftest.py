"""Shared fixtures: the real SmolLM2 tokenizer and an in-process fake stack."""
from __future__ import annotations

import asyncio

import pytest

from services.common.grpc_server import ServiceServer
from services.common.proto.rlyard.v1 import sandbox_pb2, sandbox_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.rollout.runner import load_tokenizer
from services.rollout.tasks import load_split
from services.common.net import free_port
from tests.rollout.fakes import FakeEngine, FakeSandboxService, FakeTrainerService, engine_app, solution_policy


@pytest.fixture(scope="session")
def smol_tokenizer():
    return load_tokenizer("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def all_tasks():
    return load_split("train") + load_split("eval")


class FakeStack:
    def __init__(self, engine, sandbox, trainer, engine_url, sandbox_addr, trainer_addr):
        self.engine, self.sandbox, self.trainer = engine, sandbox, trainer
        self.engine_url, self.sandbox_addr, self.trainer_addr = engine_url, sandbox_addr, trainer_addr


@pytest.fixture
async def fake_stack(smol_tokenizer, all_tasks):
    import uvicorn

    engine = FakeEngine(smol_tokenizer, solution_policy(all_tasks, wrong_rate=0.4, seed=1))
    sandbox = FakeSandboxService()
    trainer = FakeTrainerService(engine)
    sb_server = ServiceServer("127.0.0.1", 0)
    sb_server.add(sandbox_pb2_grpc.add_SandboxServicer_to_server, sandbox,
                  sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name)
    tr_server = ServiceServer("127.0.0.1", 0)
    tr_server.add(trainer_pb2_grpc.add_TrainerServicer_to_server, trainer,
                  trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name)
    sb_port = await sb_server.start()
    tr_port = await tr_server.start()
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(engine_app(engine), host="127.0.0.1", port=port, log_level="error",
                                         lifespan="off"))
    http.install_signal_handlers = lambda: None
    task = asyncio.create_task(http.serve())
    while not http.started:
        await asyncio.sleep(0.02)
    yield FakeStack(engine, sandbox, trainer, f"http://127.0.0.1:{port}", f"127.0.0.1:{sb_port}",
                    f"127.0.0.1:{tr_port}")
    http.should_exit = True
    await task
    await sb_server.stop(0)
    await tr_server.stop(0)
