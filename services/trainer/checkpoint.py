"""Save and restore the trainer: weights (safetensors), optimiser state, step and RNG.

A checkpoint is a folder `<dir>/step-<N>` holding `model.safetensors` (full
weights), `optimizer.pt`, `rng.pt` (one `optimizer-rank<R>.pt` / `rng-rank<R>.pt`
per rank under FSDP) and `trainer_state.json`. It is written to a hidden
temporary folder, `trainer_state.json` last, and renamed into place, so a
crash never leaves a folder that looks complete; `latest()` only sees whole
checkpoints.
"""
from __future__ import annotations

import json
import pathlib
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from services.trainer.trainer import PolicyTrainer

STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _names(rank: int, world: int) -> tuple[str, str]:
    """Optimiser and RNG file names: one pair per rank when the optimiser state is sharded."""
    if world == 1:
        return "optimizer.pt", "rng.pt"
    return f"optimizer-rank{rank}.pt", f"rng-rank{rank}.pt"


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def save(trainer: PolicyTrainer, path: str | pathlib.Path) -> pathlib.Path:
    """Write a checkpoint of `trainer` to `path` and return it. Under FSDP every rank calls this:
    rank 0 writes the gathered weights and the state, each rank its optimiser shard and RNG."""
    path = pathlib.Path(path)
    rank, world = trainer.rank, trainer.world
    with trainer.lock:
        weights = {n: t.detach().to("cpu").contiguous() for n, t in trainer.named_weights()}
        optim = trainer.optimizer.state_dict()
        state = {"step": trainer.step, "policy_version": trainer.policy_version, "world_size": world,
                 "model": trainer.model_name, "dtype": str(trainer.dtype).removeprefix("torch.")}
    tmp = path.parent / f".{path.name}.tmp"  # hidden: latest() never sees a half-written folder
    try:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_file(weights, str(tmp / "model.safetensors"))
        _barrier(world)
        opt_name, rng_name = _names(rank, world)
        torch.save(optim, tmp / opt_name)
        torch.save(rng_state(), tmp / rng_name)
        _barrier(world)
        if rank == 0:
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        _barrier(world)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def latest(directory: str | pathlib.Path) -> pathlib.Path | None:
    """The complete checkpoint with the highest step under `directory`, or None."""
    d = pathlib.Path(directory)
    found = []
    for p in d.glob("step-*") if d.is_dir() else []:
        if (p / STATE_FILE).exists():
            try:
                found.append((int(p.name.split("-", 1)[1]), p))
            except ValueError:
                continue
    return max(found)[1] if found else None


def load(trainer: PolicyTrainer, path: str | pathlib.Path) -> dict:
    """Restore `trainer` from a checkpoint folder; return its trainer_state.json.
    Under FSDP every rank calls this and takes its own shard; the world size must match."""
    path = pathlib.Path(path)
    if not (path / STATE_FILE).exists():
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_FILE})")
    state = json.loads((path / STATE_FILE).read_text())
    if int(state.get("world_size", 1)) != trainer.world:
        raise CheckpointError(f"{path} was written by {state.get('world_size', 1)} ranks; this trainer has "
                              f"{trainer.world} (the optimiser state is sharded per rank)")
    opt_name, rng_name = _names(trainer.rank, trainer.world)
    weights = load_file(str(path / "model.safetensors"))
    optim = torch.load(path / opt_name, weights_only=False)
    rng = torch.load(path / rng_name, weights_only=False)
    with trainer.lock:
        params = dict(trainer.lm.named_parameters())
        missing = set(params) ^ set(weights)
        if missing:
            raise CheckpointError(f"checkpoint {path} does not fit the model: {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                src = weights[name]
                if tuple(src.shape) != tuple(p.shape):
                    raise CheckpointError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(p.shape)}")
                _copy_into(p, src)
        try:
            trainer.optimizer.load_state_dict(optim)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
        trainer.step = int(state["step"])
        trainer.policy_version = int(state["policy_version"])
        set_rng_state(rng)
    return state


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, or into this rank's shard of a DTensor."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import distribute_tensor
        shard = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def size_bytes(path: str | pathlib.Path) -> int:
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())
