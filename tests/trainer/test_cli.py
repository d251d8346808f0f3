"""The real entry point: `python -m services.trainer` serves gRPC, checkpoints, stops on SIGTERM,
and `--resume` picks up the latest checkpoint after a restart."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest

from services.common.grpc_server import channel, check_health
from services.common.packing import pack_floats, pack_ids
from services.common.proto.rlyard.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.net import free_port
from tests.trainer.conftest import tiny_model


def start(model_dir, ckpt_dir, port, *extra):
    return subprocess.Popen([sys.executable, "-m", "services.trainer", "--host", "127.0.0.1", "--port", str(port),
                             "--model", str(model_dir), "--device", "cpu", "--checkpoint-dir", str(ckpt_dir),
                             "--lr", "0.01", "--log-level", "WARNING", *extra],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def wait_serving(proc, target, timeout=120.0):
    for _ in range(int(timeout * 4)):
        if proc.poll() is not None:
            raise RuntimeError(f"trainer exited with {proc.returncode}")
        if await check_health(target, timeout=0.5):
            return
        await asyncio.sleep(0.25)
    raise TimeoutError("trainer did not start")


def step_chunks():
    yield trainer_pb2.TrainStepChunk(header=trainer_pb2.StepHeader(num_episodes=1))
    yield trainer_pb2.TrainStepChunk(episode=trainer_pb2.Episode(
        prompt_ids=pack_ids([1, 2, 3]), response_ids=pack_ids([4, 5, 6]), loss_mask=pack_ids([1, 1, 1]),
        rollout_logprobs=pack_floats([-4.0, -4.0, -4.0]), advantage=1.0))


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


async def test_serve_checkpoint_sigterm_and_resume(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model().save_pretrained(model_dir)
    ckpt = tmp_path / "ckpt"
    port = free_port()
    target = f"127.0.0.1:{port}"
    proc = start(model_dir, ckpt, port)
    try:
        await wait_serving(proc, target)
        async with channel(target) as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            for _ in range(2):
                await stub.TrainStep(step_chunks())
            info = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest())
            assert info.step == 2 and info.path.endswith("step-2") and info.size_bytes > 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(tmp_path / "nope")))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        assert stop(proc) == 0  # graceful shutdown on SIGTERM

    proc = start(model_dir, ckpt, port, "--resume")
    try:
        await wait_serving(proc, target)
        async with channel(target) as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            status = await stub.GetStatus(common_pb2.Empty())
            assert status.step == 2 and status.policy_version == 2
            reply = await stub.TrainStep(step_chunks())
            assert reply.step == 3
    finally:
        assert stop(proc) == 0


def test_batch_invariant_refused_under_torchrun(monkeypatch, capfd):
    """The batch-invariant forward reads parameters that FSDP2 shards: under torchrun it is refused up front."""
    from services.trainer.__main__ import main
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--batch-invariant", "--device", "cpu"]) == 2
    assert "--batch-invariant is single-process" in capfd.readouterr().err
