"""Checkpoint and resume: an interrupted run ends bit-identical to an uninterrupted one."""
from __future__ import annotations


import pytest
import torch

from services.trainer import checkpoint
from services.trainer.losses import LossSettings
from services.trainer.trainer import PolicyTrainer, TrainerSettings
from tests.trainer.conftest import random_episodes, tiny_model

SETTINGS = TrainerSettings(lr=1e-2, weight_decay=0.01, micro_batch_tokens=32, loss=LossSettings(lr=1e-2))


def new_trainer():
    return PolicyTrainer(tiny_model(seed=0), "cpu", SETTINGS)


def run_steps(trainer, first, last):
    for s in range(first, last):
        trainer.train_step(random_episodes(4, seed=100 + s), SETTINGS.loss)


def test_interrupted_and_resumed_run_is_identical(tmp_path):
    straight = new_trainer()
    run_steps(straight, 0, 5)

    first = new_trainer()
    run_steps(first, 0, 2)
    saved = checkpoint.save(first, tmp_path / f"step-{first.step}")
    run_steps(first, 2, 3)  # work after the checkpoint is lost with the "crash"
    del first

    assert checkpoint.latest(tmp_path) == saved
    resumed = PolicyTrainer(tiny_model(seed=1), "cpu", SETTINGS)  # other init: all must come from disk
    state = checkpoint.load(resumed, saved)
    assert state["step"] == 2 and resumed.step == 2 and resumed.policy_version == 2
    run_steps(resumed, 2, 5)
    for (n, a), (_, b) in zip(straight.lm.named_parameters(), resumed.lm.named_parameters()):
        assert torch.equal(a, b), n
    assert straight.optimizer.step_count == resumed.optimizer.step_count == 5
    for n, st in straight.optimizer.state.items():
        for k, t in st.items():
            assert torch.equal(t, resumed.optimizer.state[n][k]), (n, k)


def test_rng_restored(tmp_path):
    tr = new_trainer()
    saved = checkpoint.save(tr, tmp_path / "step-0")
    expected = torch.rand(3)
    torch.rand(5)
    checkpoint.load(tr, saved)
    assert torch.equal(torch.rand(3), expected)


def test_latest_ignores_incomplete_and_picks_highest(tmp_path):
    tr = new_trainer()
    checkpoint.save(tr, tmp_path / "step-3")
    checkpoint.save(tr, tmp_path / "step-12")
    (tmp_path / "step-40").mkdir()  # no trainer_state.json: a crashed write
    (tmp_path / ".step-50-tmp").mkdir()
    assert checkpoint.latest(tmp_path).name == "step-12"
    assert checkpoint.latest(tmp_path / "nothing") is None


def test_checkpoint_of_another_model_refused(tmp_path):
    saved = checkpoint.save(new_trainer(), tmp_path / "step-0")
    other = PolicyTrainer(tiny_model(tie=False), "cpu", SETTINGS)
    with pytest.raises(checkpoint.CheckpointError, match="does not fit"):
        checkpoint.load(other, saved)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint"):
        checkpoint.load(other, tmp_path)
