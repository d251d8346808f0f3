"""gRPC Trainer service: maps RPCs onto PolicyTrainer, WeightSyncer and checkpoints.

Heavy work (a training step, a checkpoint) runs in a worker thread so the
server keeps answering GetStatus and health checks meanwhile. Every failure
becomes a gRPC status with a message; none stops the server.
"""
from __future__ import annotations

import asyncio
import logging
import pathlib

import grpc

from services.common.proto.rlyard.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.sglang_client import EngineError
from services.trainer import checkpoint
from services.trainer.batch import BatchError, check_batch, parse_episode
from services.trainer.losses import LossSettings
from services.trainer.trainer import NonFiniteStep, PolicyTrainer
from services.trainer.weight_sync import WeightSyncer

log = logging.getLogger(__name__)

_LOSS_FIELDS = ("eps_low", "eps_high", "dual_clip_c", "aggregation", "kl_coef", "tis_cap", "lr", "temperature")


def loss_from_proto(msg: trainer_pb2.LossConfig, defaults: LossSettings) -> LossSettings:
    """Defaults overridden by the fields the client set."""
    return defaults.merged(**{f: getattr(msg, f) for f in _LOSS_FIELDS if msg.HasField(f)})


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """The Trainer service of proto/rlyard/v1/trainer.proto."""

    def __init__(self, trainer: PolicyTrainer, syncer: WeightSyncer,
                 checkpoint_dir: str | None = None) -> None:
        self.trainer = trainer
        self.syncer = syncer
        self.checkpoint_dir = pathlib.Path(checkpoint_dir) if checkpoint_dir else None
        self.synced_version = ""
        self._sync_lock = asyncio.Lock()

    async def TrainStep(self, request_iterator, context: grpc.aio.ServicerContext) -> trainer_pb2.TrainStepResult:
        header = None
        episodes = []
        tr = self.trainer
        try:
            async for chunk in request_iterator:
                kind = chunk.WhichOneof("chunk")
                if kind == "header":
                    if header is not None:
                        raise BatchError(grpc.StatusCode.INVALID_ARGUMENT, "a second StepHeader in one stream")
                    header = chunk.header
                    if header.expected_policy_version and header.expected_policy_version != tr.policy_version:
                        raise BatchError(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"expected_policy_version {header.expected_policy_version} but the "
                                         f"trainer holds {tr.policy_version}")
                elif kind == "episode":
                    if header is None:
                        raise BatchError(grpc.StatusCode.INVALID_ARGUMENT,
                                         "the stream must start with a StepHeader before any Episode")
                    episodes.append(parse_episode(chunk.episode, len(episodes), tr.vocab_size, tr.max_len))
                else:
                    raise BatchError(grpc.StatusCode.INVALID_ARGUMENT, "empty TrainStepChunk")
            if header is None:
                raise BatchError(grpc.StatusCode.INVALID_ARGUMENT, "empty stream: send a StepHeader then episodes")
            check_batch(episodes, header.num_episodes, tr.policy_version)
            try:
                loss = loss_from_proto(header.loss, tr.settings.loss)
                loss.validate()
            except (ValueError, TypeError) as exc:
                raise BatchError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            metrics = await asyncio.to_thread(tr.train_step, episodes, loss)
        except BatchError as exc:
            await context.abort(exc.code, str(exc))
        except NonFiniteStep as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except (RuntimeError, MemoryError) as exc:  # e.g. CUDA out of memory: the step is dropped
            log.exception("training step failed")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED if "out of memory" in str(exc)
                                else grpc.StatusCode.INTERNAL, f"training step failed: {exc}")
        log.info("step %d (%s): loss %.4f, %d tokens, %.2fs", tr.step, header.step_id or "-",
                 metrics["loss"], metrics["tokens"], metrics["step_s"])
        return trainer_pb2.TrainStepResult(step=tr.step, policy_version=tr.policy_version, metrics=metrics)

    async def SyncWeights(self, request, context) -> trainer_pb2.SyncWeightsResult:
        version = request.weight_version or str(self.trainer.policy_version)
        try:
            async with self._sync_lock:
                # No optimiser step while the engines read the weights; wait for the lock off the loop.
                await asyncio.to_thread(self.trainer.lock.acquire)
                try:
                    report = await self.syncer.sync(self.trainer.named_weights, self.trainer.lm.config,
                                                    list(request.engine_urls), method=request.method,
                                                    weight_version=version, bucket_mb=request.bucket_mb,
                                                    flush_cache=request.flush_cache, arena=self.trainer.arena)
                finally:
                    self.trainer.lock.release()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineError as exc:
            code = grpc.StatusCode.UNAVAILABLE if exc.status is None else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, f"engine refused the weights: {exc}")
        except (RuntimeError, OSError) as exc:
            log.exception("weight sync failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"weight sync failed: {exc}")
        self.synced_version = report.weight_version
        log.info("synced %s to %s by %s: %.1f MB, %.2f ms", version, list(request.engine_urls),
                 report.method, report.bytes / 1e6, report.timing["total"])
        return trainer_pb2.SyncWeightsResult(weight_version=report.weight_version, bytes=report.bytes,
                                             buckets=report.buckets, method=report.method,
                                             timing=common_pb2.Timing(ms=report.timing))

    async def SaveCheckpoint(self, request, context) -> trainer_pb2.CheckpointInfo:
        path = request.path
        if not path:
            if self.checkpoint_dir is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "no path given and the trainer has no --checkpoint-dir")
            path = str(self.checkpoint_dir / f"step-{self.trainer.step}")
        try:
            save = getattr(self.trainer, "save_checkpoint", None)  # FSDP: all ranks take part
            if save is not None:
                await asyncio.to_thread(save, path)
                out = pathlib.Path(path)
            else:
                out = await asyncio.to_thread(checkpoint.save, self.trainer, path)
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot write checkpoint {path}: {exc}")
        return self._checkpoint_info(out)

    async def LoadCheckpoint(self, request, context) -> trainer_pb2.CheckpointInfo:
        path = pathlib.Path(request.path) if request.path else None
        if path is None:
            if self.checkpoint_dir is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "no path given and the trainer has no --checkpoint-dir")
            path = checkpoint.latest(self.checkpoint_dir)
            if path is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint under {self.checkpoint_dir}")
        try:
            await asyncio.to_thread(getattr(self.trainer, "load_checkpoint", None)
                                    or (lambda p: checkpoint.load(self.trainer, p)), path)
        except checkpoint.CheckpointError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"cannot read checkpoint {path}: {exc}")
        return self._checkpoint_info(pathlib.Path(path))

    def _checkpoint_info(self, path: pathlib.Path) -> trainer_pb2.CheckpointInfo:
        """The reply of Save/LoadCheckpoint: where the checkpoint is and the trainer's state now."""
        return trainer_pb2.CheckpointInfo(path=str(path), step=self.trainer.step,
                                          policy_version=self.trainer.policy_version,
                                          size_bytes=checkpoint.size_bytes(path))

    async def GetStatus(self, request, context) -> trainer_pb2.TrainerStatus:
        tr = self.trainer
        return trainer_pb2.TrainerStatus(model=tr.model_name, device=str(tr.device),
                                         dtype=str(tr.dtype).removeprefix("torch."), step=tr.step,
                                         policy_version=tr.policy_version, num_parameters=tr.num_parameters(),
                                         peak_memory_gb=tr.peak_memory_gb(),
                                         synced_weight_version=self.synced_version)
