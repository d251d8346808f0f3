"""Whole runs (sync and async) through the orchestrator's real gRPC/HTTP clients against test fakes."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.packing import unpack
from services.rollout.config import RunConfig
from services.rollout.manager import RunManager
from services.rollout.runner import Endpoints

BASE = {
    "tasks": ["python_product", "kernel_name_lower", "numbers_file_lines", "grep_error_lines"],
    "prompts_per_step": 2, "group_size": 4, "concurrency": 8,
    "sampling": {"max_new_tokens": 64}, "episode": {"max_turns": 3, "command_timeout_s": 5},
    "eval": {"every": 2, "tasks": ["eval_python_product", "eval_word_count"]},
}


async def _run(stack, tmp_path, **over) -> tuple[RunManager, str]:
    mgr = RunManager(str(tmp_path / "runs"), Endpoints(stack.engine_url, stack.trainer_addr, stack.sandbox_addr))
    cfg = RunConfig.model_validate({**BASE, **over})
    info = mgr.start(cfg)
    await asyncio.wait_for(mgr._live[info.run_id].task, 120)
    return mgr, info.run_id


async def test_sync_run_trains_syncs_evaluates_and_records(fake_stack, tmp_path):
    mgr, run_id = await _run(fake_stack, tmp_path, steps=3)
    info = mgr.get(run_id)
    assert info.state == "succeeded", info.message
    assert info.step == 3 and info.policy_version == 3
    tr = fake_stack.trainer
    assert len(tr.batches) == 3 and len(tr.syncs) == 4  # one at the start puts the engine on-policy
    assert [s.weight_version for s in tr.syncs] == ["0", "1", "2", "3"]
    assert fake_stack.engine.weight_version == "3"
    for batch in tr.batches:
        assert len(batch) == 8
        advs = np.array([e.advantage for e in batch]).reshape(2, 4)
        assert np.allclose(advs.sum(axis=1), 0.0, atol=1e-6)
        for e in batch:
            mask = unpack(e.loss_mask)
            lps = unpack(e.rollout_logprobs)
            assert np.all(lps[mask == 0] == 0.0) and np.all(lps[mask == 1] != 0.0)
    # Every sandbox made for an episode (and every forked-from parent) was killed.
    sb = fake_stack.sandbox
    assert sb.forked > 0 and sb.killed == sb.created + sb.forked and not sb.boxes

    rd = mgr.run_dir(run_id)
    steps = rd.read_jsonl("metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    s = steps[0]
    for key in ("reward_mean", "reward_std", "success_rate", "episode_len_mean", "turns_mean", "tokens_generated",
                "tokens_trained", "time/generation_s", "time/sandbox_s", "time/training_s", "time/weight_sync_s",
                "logprob_mismatch", "staleness_mean", "episodes_failed", "train/loss"):
        assert key in s, key
    assert any(k.startswith("success/") for k in s)
    assert 0 < s["success_rate"] < 1  # the scripted policy answers wrong 40% of the time
    evals = rd.read_jsonl("eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert evals[0]["eval/episodes"] == 2
    samples = rd.read_jsonl("samples.jsonl")
    assert samples and "<tool_response>" in samples[0]["response_text"]
    for name in ("reward.png", "eval.png", "time.png", "index.html"):
        assert (rd.path / "report" / name).stat().st_size > 0
    assert list((rd.path / "tb").glob("events.out.tfevents.*"))
    assert fake_stack.trainer.checkpoints == 1

    # A restarted orchestrator lists the run from disk.
    again = RunManager(str(tmp_path / "runs"), Endpoints())
    assert [r.run_id for r in again.list()] == [run_id]
    assert again.get(run_id).state == "succeeded"


async def test_async_run_overlaps_generation_and_training(fake_stack, tmp_path):
    fake_stack.trainer.train_delay_s = 0.3
    mgr, run_id = await _run(fake_stack, tmp_path, steps=3, mode="async", eval={"every": 0},
                             **{"async": {"staleness_k": 1, "stale": "drop"}})
    info = mgr.get(run_id)
    assert info.state == "succeeded", info.message
    assert len(fake_stack.trainer.batches) == 3
    assert fake_stack.engine.paused == 4  # every weight update landed inside pause/continue
    steps = mgr.run_dir(run_id).read_jsonl("metrics.jsonl")
    assert all(s["staleness_max"] <= 1 for s in steps)
    assert any(s["staleness_max"] == 1 for s in steps[1:])  # episodes played while the trainer trained
    versions = {e.policy_version for b in fake_stack.trainer.batches for e in b}
    assert len(versions) >= 2
    await asyncio.sleep(0.2)
    assert not fake_stack.sandbox.boxes  # in-flight episodes were cancelled and their sandboxes killed


async def test_stale_episodes_are_down_weighted(fake_stack, tmp_path):
    fake_stack.trainer.train_delay_s = 0.3
    mgr, run_id = await _run(fake_stack, tmp_path, steps=3, mode="async", eval={"every": 0},
                             **{"async": {"staleness_k": 0, "stale": "downweight", "downweight": 0.5}})
    assert mgr.get(run_id).state == "succeeded"
    weights = {e.weight for b in fake_stack.trainer.batches for e in b}
    assert 0.5 in weights and 1.0 in weights


async def test_failed_episodes_are_excluded_and_recorded(fake_stack, tmp_path):
    fake_stack.sandbox.fail_exec_every = 5
    mgr, run_id = await _run(fake_stack, tmp_path, steps=2, eval={"every": 0}, min_ok_fraction=0.3)
    assert mgr.get(run_id).state == "succeeded", mgr.get(run_id).message
    rd = mgr.run_dir(run_id)
    failures = rd.read_jsonl("failures.jsonl")
    assert failures and all(f["reason"] == "sandbox_error" for f in failures)
    assert "injected" in failures[0]["error"]
    steps = rd.read_jsonl("metrics.jsonl")
    assert sum(s["episodes_failed"] for s in steps) == len(failures)
    assert sum(s["episodes_trained"] for s in steps) == sum(len(b) for b in fake_stack.trainer.batches)


async def test_step_fails_with_a_reason_when_too_few_episodes_succeed(fake_stack, tmp_path):
    fake_stack.sandbox.fail_exec_every = 1
    mgr, run_id = await _run(fake_stack, tmp_path, steps=2, eval={"every": 0})
    info = mgr.get(run_id)
    assert info.state == "failed"
    assert "only 0 of 8 episodes succeeded" in info.message and "sandbox_error" in info.message
    assert len(mgr.run_dir(run_id).read_jsonl("failures.jsonl")) == 16  # played, replayed once, failed again
    assert not fake_stack.trainer.batches


async def test_sandbox_without_fork_falls_back_to_create(fake_stack, tmp_path):
    fake_stack.sandbox.fork = False
    mgr, run_id = await _run(fake_stack, tmp_path, steps=1, eval={"every": 0})
    assert mgr.get(run_id).state == "succeeded", mgr.get(run_id).message
    assert fake_stack.sandbox.forked == 0 and fake_stack.sandbox.created >= 8


async def test_stop_ends_a_run_after_its_step(fake_stack, tmp_path):
    mgr = RunManager(str(tmp_path / "runs"), Endpoints(fake_stack.engine_url, fake_stack.trainer_addr,
                                                       fake_stack.sandbox_addr))
    info = mgr.start(RunConfig.model_validate({**BASE, "steps": 50, "eval": {"every": 0}}))
    while mgr.get(info.run_id).step < 1:
        await asyncio.sleep(0.05)
    mgr.stop(info.run_id)
    await asyncio.wait_for(mgr._live[info.run_id].task, 60)
    final = mgr.get(info.run_id)
    assert final.state == "stopped" and 1 <= final.step < 50


async def test_unreachable_engine_fails_the_run_clearly(fake_stack, tmp_path):
    mgr, run_id = await _run(fake_stack, tmp_path, steps=1, eval={"every": 0},
                             engine_url="http://127.0.0.1:9", startup_timeout_s=2)
    info = mgr.get(run_id)
    assert info.state == "failed" and "127.0.0.1:9" in info.message


async def test_dropped_groups_still_count_in_the_step_metrics(fake_stack, tmp_path):
    # Every answer wrong and one command each: every group has equal rewards and is dropped.
    from tests.rollout.fakes import solution_policy
    from services.rollout.tasks import load_split
    fake_stack.engine.policy = solution_policy(load_split("train"), wrong_rate=1.0)
    mgr, run_id = await _run(fake_stack, tmp_path, steps=2, eval={"every": 0},
                             tasks=["python_product", "grep_error_lines"],
                             advantage={"drop_zero_variance": True})
    assert mgr.get(run_id).state == "succeeded", mgr.get(run_id).message
    steps = mgr.run_dir(run_id).read_jsonl("metrics.jsonl")
    for s in steps:
        assert s["episodes"] == 8 and s["episodes_trained"] == 0 and s["groups_dropped_zero_variance"] == 2
        assert s["reward_mean"] == pytest.approx(0.1) and s["tokens_generated"] > 0
    assert not fake_stack.trainer.batches  # nothing to learn from: no train step, no sync
    assert len(fake_stack.trainer.syncs) == 1


async def test_resume_loads_the_trainers_checkpoint_and_syncs_it(fake_stack, tmp_path):
    mgr, run_id = await _run(fake_stack, tmp_path, steps=1, eval={"every": 0}, resume=True)
    info = mgr.get(run_id)
    assert info.state == "succeeded" and info.policy_version == 8  # checkpoint at 7, then one step
    assert [s.weight_version for s in fake_stack.trainer.syncs] == ["7", "8"]


async def test_dynamic_sampling_replaces_dropped_groups(fake_stack, tmp_path):
    from tests.rollout.fakes import solution_policy
    from services.rollout.tasks import load_split
    calls = {"n": 0}
    right = solution_policy(load_split("train"), wrong_rate=0.0)
    wrong = solution_policy(load_split("train"), wrong_rate=1.0)

    def policy(context):  # the first group's episodes all fail (dropped), later ones vary
        calls["n"] += 1
        return (wrong if calls["n"] <= 8 else (right if calls["n"] % 3 else wrong))(context)

    fake_stack.engine.policy = policy
    mgr, run_id = await _run(fake_stack, tmp_path, steps=1, eval={"every": 0}, prompts_per_step=1,
                             tasks=["python_product"], concurrency=1,
                             advantage={"drop_zero_variance": True, "dynamic_sampling": True,
                                        "max_extra_rounds": 2})
    assert mgr.get(run_id).state == "succeeded", mgr.get(run_id).message
    (s,) = mgr.run_dir(run_id).read_jsonl("metrics.jsonl")
    assert s["groups_dropped_zero_variance"] >= 1 and s["episodes"] >= 8 and s["episodes_trained"] == 4
    assert len(fake_stack.trainer.batches) == 1
