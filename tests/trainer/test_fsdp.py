"""FSDP2 on the CPU (gloo, 2 ranks): sharded training equals unsharded training, full tensors
can be gathered for a weight sync, and a sharded checkpoint resumes exactly."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from services.trainer.losses import LossSettings
from services.trainer.trainer import PolicyTrainer, TrainerSettings
from services.common.net import free_port
from tests.trainer.conftest import random_episodes, tiny_model

SETTINGS = TrainerSettings(lr=1e-2, micro_batch_tokens=24, loss=LossSettings(lr=1e-2))
STEPS = 2


def batches():
    return [random_episodes(5, seed=40 + s) for s in range(STEPS)]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from services.trainer import checkpoint
    from services.trainer.distributed import shard_policy
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tr = PolicyTrainer(tiny_model(seed=0), "cpu", SETTINGS, prepare=shard_policy)
        local = {n: p.to_local().numel() for n, p in tr.lm.named_parameters()}
        metrics = [tr.train_step(b, SETTINGS.loss) for b in batches()]
        full = {n: t.clone() for n, t in tr.named_weights()}  # the gather a sync does
        saved = checkpoint.save(tr, os.path.join(out, f"step-{tr.step}"))
        fresh = PolicyTrainer(tiny_model(seed=7), "cpu", SETTINGS, prepare=shard_policy)
        checkpoint.load(fresh, saved)
        reloaded = {n: t.clone() for n, t in fresh.named_weights()}
        if rank == 0:
            torch.save({"full": full, "local": local, "metrics": metrics, "reloaded": reloaded,
                        "step": fresh.step}, os.path.join(out, "rank0.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_match_single_process(tmp_path):
    mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)

    single = PolicyTrainer(tiny_model(seed=0), "cpu", SETTINGS)
    want = [single.train_step(b, SETTINGS.loss) for b in batches()]
    total = {n: p.numel() for n, p in single.lm.named_parameters()}
    # each rank holds about half of every parameter: really sharded
    assert all(res["local"][n] <= (total[n] + 1) // 2 for n in total)
    for n, p in single.lm.named_parameters():
        torch.testing.assert_close(res["full"][n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)
        assert torch.equal(res["reloaded"][n], res["full"][n]), n
    assert res["step"] == STEPS
    for got, exp in zip(res["metrics"], want):
        for key in ("loss", "tokens", "clip_frac", "logprob_diff_mean", "grad_norm"):
            assert got[key] == pytest.approx(exp[key], rel=1e-4, abs=1e-6), key
        assert got["ranks"] == 2
