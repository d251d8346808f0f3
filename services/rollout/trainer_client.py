"""Async client of the trainer's gRPC API: stream a batch, sync weights, checkpoints."""
from __future__ import annotations

from typing import AsyncIterator

import grpc

from services.common.grpc_server import channel
from services.common.packing import pack_floats, pack_ids
from services.common.proto.rlyard.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.rollout.config import LossConfig
from services.rollout.episode import Episode


class TrainerError(RuntimeError):
    """A trainer call failed; `code` is the gRPC status name."""

    def __init__(self, op: str, code: str, detail: str) -> None:
        super().__init__(f"trainer {op} failed: {code}: {detail}")
        self.op, self.code, self.detail = op, code, detail


def _wrap(op: str, exc: grpc.aio.AioRpcError) -> TrainerError:
    return TrainerError(op, exc.code().name, exc.details() or "")


def episode_message(ep: Episode) -> trainer_pb2.Episode:
    return trainer_pb2.Episode(
        prompt_ids=pack_ids(ep.prompt_ids), response_ids=pack_ids(ep.response_ids),
        loss_mask=pack_ids(ep.loss_mask), rollout_logprobs=pack_floats(ep.logprobs),
        advantage=ep.advantage, policy_version=ep.policy_version, weight=ep.weight)


def loss_message(loss: LossConfig, temperature: float) -> trainer_pb2.LossConfig:
    fields = {k: v for k, v in loss.model_dump().items() if v is not None}
    return trainer_pb2.LossConfig(temperature=temperature, **fields)


class TrainerClient:
    """The orchestrator's connection to the trainer."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = channel(target)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def train_step(self, episodes: list[Episode], loss: LossConfig, temperature: float,
                         step_id: str, expected_version: int = 0) -> trainer_pb2.TrainStepResult:
        header = trainer_pb2.StepHeader(expected_policy_version=expected_version,
                                        num_episodes=len(episodes), step_id=step_id,
                                        loss=loss_message(loss, temperature))

        async def chunks() -> AsyncIterator[trainer_pb2.TrainStepChunk]:
            yield trainer_pb2.TrainStepChunk(header=header)
            for ep in episodes:
                yield trainer_pb2.TrainStepChunk(episode=episode_message(ep))

        try:
            return await self._stub.TrainStep(chunks(), timeout=3600)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("TrainStep", exc) from exc

    async def sync_weights(self, engine_urls: list[str], method: str = "",
                           weight_version: str = "") -> trainer_pb2.SyncWeightsResult:
        req = trainer_pb2.SyncWeightsRequest(engine_urls=engine_urls, method=method,
                                             weight_version=weight_version, flush_cache=True)
        try:
            return await self._stub.SyncWeights(req, timeout=900)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("SyncWeights", exc) from exc

    async def save_checkpoint(self, path: str = "") -> trainer_pb2.CheckpointInfo:
        try:
            return await self._stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=path), timeout=900)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("SaveCheckpoint", exc) from exc

    async def load_checkpoint(self, path: str = "") -> trainer_pb2.CheckpointInfo:
        try:
            return await self._stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=path), timeout=900)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("LoadCheckpoint", exc) from exc

    async def status(self) -> trainer_pb2.TrainerStatus:
        try:
            return await self._stub.GetStatus(common_pb2.Empty(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise _wrap("GetStatus", exc) from exc
