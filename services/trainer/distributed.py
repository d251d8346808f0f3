"""Scale-out: one trainer spread over several GPUs (or CPU processes) with FSDP2.

Launched by torchrun (`torchrun --nproc-per-node N -m services.trainer --device cuda ...`),
every rank loads the model and shards it with `fully_shard`: each decoder
layer is one FSDP unit, and the PolicyModel wrapper is the root unit (it owns
the embedding, the tied vocabulary projection and the final norm). Rank 0
serves gRPC; every command that involves collectives (a training step,
gathering full weights for a sync or a checkpoint, loading a checkpoint) is
broadcast by rank 0 and executed by all ranks in the same order, so the
collectives pair up. The other ranks run `follow()` until rank 0 stops.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from services.trainer.batch import EpisodeArrays
from services.trainer.logprobs import PolicyModel
from services.trainer.losses import LossSettings
from services.trainer.trainer import PolicyTrainer

log = logging.getLogger(__name__)


def init_distributed(device: str | None) -> tuple[int, int, str]:
    """Join the torchrun group (NCCL on GPUs, gloo on CPUs); return (rank, world, this rank's device)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = (device or "cuda").startswith("cuda") and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, f"cuda:{local}" if use_cuda else "cpu"


def shard_policy(policy: PolicyModel) -> None:
    """FSDP2: one unit per decoder layer, the wrapper as root (embedding, head and norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(policy.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)


class DistributedTrainer:
    """Rank 0's view: the PolicyTrainer API, each collective call broadcast to the other ranks first."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self._trainer = trainer
        self._order = threading.Lock()  # one broadcast command at a time, in one order

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def _command(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=0)

    def train_step(self, episodes: Sequence[EpisodeArrays], loss: LossSettings) -> dict[str, float]:
        loss.validate()
        with self._order:
            self._command("train_step", list(episodes), loss)
            return self._trainer.train_step(episodes, loss)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        with self._order:
            self._command("gather")
            weights = list(self._trainer.named_weights())
        return iter(weights)

    def save_checkpoint(self, path: str) -> None:
        from services.trainer import checkpoint
        with self._order:
            self._command("save", str(path))
            checkpoint.save(self._trainer, path)

    def load_checkpoint(self, path: str) -> dict:
        from services.trainer import checkpoint
        with self._order:
            self._command("load", str(path))
            return checkpoint.load(self._trainer, path)

    def stop_followers(self) -> None:
        with self._order:
            self._command("stop")


def follow(trainer: PolicyTrainer) -> None:
    """Ranks > 0: run what rank 0 broadcasts until it says stop. A failing command is logged
    (rank 0 sees the same failure and reports it); the loop goes on."""
    from services.trainer import checkpoint
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        name, *args = box[0]
        if name == "stop":
            return
        try:
            if name == "train_step":
                trainer.train_step(*args)
            elif name == "gather":
                for _ in trainer.named_weights():
                    pass
            elif name == "save":
                checkpoint.save(trainer, args[0])
            elif name == "load":
                checkpoint.load(trainer, args[0])
        except Exception:
            log.exception("rank %d: %s failed", dist.get_rank(), name)


def main_distributed(args) -> int:
    """Entry point under torchrun: build and shard the trainer on every rank; rank 0 serves."""
    from services.trainer.__main__ import _settings, serve
    from services.trainer.model import load_model, parse_dtype

    rank, world, device = init_distributed(args.device)
    settings = _settings(args)
    torch.manual_seed(args.seed)
    model, folder = load_model(args.model, device, parse_dtype(args.dtype, device), args.random_init,
                               args.seed, not args.no_gradient_checkpointing)
    trainer = PolicyTrainer(model, device, settings, model_name=str(folder), prepare=shard_policy)
    log.info("rank %d/%d on %s: model sharded with FSDP2", rank, world, device)
    try:
        if rank == 0:
            wrapped = DistributedTrainer(trainer)
            try:
                return asyncio.run(serve(args, trainer=wrapped))
            finally:
                wrapped.stop_followers()
        follow(trainer)
        return 0
    finally:
        dist.destroy_process_group()
