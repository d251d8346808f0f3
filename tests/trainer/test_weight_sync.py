"""Weight sync into the real embedded engine (a separate process on the CPU): ipc, disk and nccl (gloo).

The engine serves the real SmolLM2-135M weights; the trainer holds the same
model, takes an optimiser step with a large learning rate (so the weights
really change), and pushes them. Afterwards the engine's log-probs of a fixed
sequence must equal the trainer's (both fp32 on the CPU), and must differ
from what the engine returned before the push. The engine demands
begin/end_weight_update sessions (like SGLang 0.5.23), so the client's
session fallback is exercised too.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from services.common.model_store import ModelNotFound, resolve_model
from services.common.sglang_client import SGLangClient
from services.trainer.batch import EpisodeArrays
from services.trainer.losses import LossSettings
from services.trainer.model import load_model
from services.trainer.trainer import PolicyTrainer, TrainerSettings
from services.trainer.weight_sync import WeightSyncer
from services.trainer.weight_sync.buckets import plan_buckets
from services.common.net import free_port

try:
    import services.engine.server  # noqa: F401
    ENGINE_ERROR = None
except Exception as exc:  # the engine is another engineer's work; say exactly why we skip
    ENGINE_ERROR = f"services.engine is not importable: {type(exc).__name__}: {exc}"

try:
    MODEL, MODEL_ERROR = resolve_model(), ""
except ModelNotFound as exc:
    MODEL, MODEL_ERROR = None, f"SmolLM2 not provisioned (run make install): {exc}"

_ENGINE_MARKS = [pytest.mark.skipif(ENGINE_ERROR is not None, reason=ENGINE_ERROR or ""),
                 pytest.mark.skipif(MODEL is None, reason=MODEL_ERROR),
                 pytest.mark.slow]  # one engine process + three 538 MB pushes: ~1.5 min on 2 cores


def needs_engine(fn):
    for mark in _ENGINE_MARKS:
        fn = mark(fn)
    return fn

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]
RESPONSE = [19556, 28, 339, 5248, 7192, 12, 2]


@pytest.fixture(scope="module")
def engine_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--port", str(port), "--device", "cpu",
                             "--max-running-requests", "4", "--log-level", "WARNING",
                             # like SGLang 0.5.23: tensor/distributed updates only inside a session
                             "--require-weight-update-session"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"

    async def ready():
        async with SGLangClient(url) as c:
            await c.wait_ready(240)
    try:
        asyncio.run(ready())
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def trainer():
    model, folder = load_model(None, "cpu", torch.float32, gradient_checkpointing=True)
    return PolicyTrainer(model, "cpu", TrainerSettings(lr=1e-3), model_name=str(folder))


async def engine_logprobs(url: str) -> np.ndarray:
    """The engine's log-probs of RESPONSE after PROMPT (prefill with logprob_start_len)."""
    async with SGLangClient(url) as c:
        reply = await c.generate(PROMPT + RESPONSE, {"max_new_tokens": 1, "temperature": 1.0},
                                 return_logprob=True, logprob_start_len=len(PROMPT) - 1)
    entries = reply["meta_info"]["input_token_logprobs"]
    values = [e[0] for e in entries if e[0] is not None]
    return np.array(values[-len(RESPONSE):], dtype=np.float64)


def trainer_logprobs(tr: PolicyTrainer) -> np.ndarray:
    ep = EpisodeArrays(prompt_ids=np.array(PROMPT), response_ids=np.array(RESPONSE),
                       loss_mask=np.ones(len(RESPONSE), bool), rollout_logprobs=np.zeros(len(RESPONSE), np.float32),
                       advantage=0.0, policy_version=0, weight=1.0)
    return tr.logprobs([ep])[0].double().numpy()


def take_step(tr: PolicyTrainer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    eps = [EpisodeArrays(prompt_ids=np.array(PROMPT), response_ids=rng.integers(0, 49152, 12),
                         loss_mask=np.ones(12, bool), rollout_logprobs=np.full(12, -10, np.float32),
                         advantage=1.0, policy_version=0, weight=1.0) for _ in range(2)]
    tr.train_step(eps, LossSettings(lr=1e-3))


@pytest.mark.parametrize("method", ["ipc", "ipc-arena", "disk", "nccl"])
@needs_engine
async def test_sync_changes_engine_to_trainer_weights(engine_url, trainer, method, tmp_path):
    arena = None
    if method == "ipc-arena":  # buckets are slices of the trainer's parameter arena: no flatten
        method, arena = "ipc", trainer.arena
        assert arena is not None and arena.intact()
    before = await engine_logprobs(engine_url)
    take_step(trainer, seed=len(method))
    want = trainer_logprobs(trainer)
    assert np.abs(want - before).max() > 1e-3, "the step did not change the weights"
    syncer = WeightSyncer(bucket_mb=64, disk_root=str(tmp_path), nccl_master=("127.0.0.1", free_port()))
    try:
        version = f"{method}-{trainer.step}"
        report = await syncer.sync(trainer.named_weights, trainer.lm.config, [engine_url], method=method,
                                   weight_version=version, arena=arena)
    finally:
        await syncer.aclose()
    assert report.bytes == sum(p.numel() * 4 for p in trainer.lm.parameters())
    assert report.buckets >= (2 if method != "disk" else 1)  # 538 MB in 64 MiB buckets
    for phase in ("gather", "flatten", "copy", "serialise", "engine_load", "total"):
        assert phase in report.timing
    assert report.timing["engine_load"] > 0 and report.timing["total"] >= report.timing["engine_load"]
    after = await engine_logprobs(engine_url)
    np.testing.assert_allclose(after, want, atol=2e-4)
    async with SGLangClient(engine_url) as c:
        assert (await c.model_info())["weight_version"] == version


@needs_engine
async def test_engine_refusal_surfaces(engine_url, trainer):
    syncer = WeightSyncer()
    bad = lambda: [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))]  # noqa: E731  wrong shape
    from services.common.sglang_client import EngineError
    try:
        with pytest.raises(EngineError, match="shape"):
            await syncer.sync(bad, trainer.lm.config, [engine_url], method="ipc", weight_version="bad")
    finally:
        await syncer.aclose()


def test_buckets_group_by_dtype_and_respect_cap():
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10, dtype=torch.bfloat16)), ("c", torch.zeros(20)),
             ("d", torch.zeros(5)), ("e", torch.zeros(100))]
    buckets = plan_buckets(named, cap_bytes=120)
    dtypes = [{named[i][1].dtype for i in b} for b in buckets]
    assert all(len(d) == 1 for d in dtypes)
    assert sorted(i for b in buckets for i in b) == list(range(5))
    for b in buckets:
        assert len(b) == 1 or sum(named[i][1].numel() * named[i][1].element_size() for i in b) <= 120
    assert [4] in buckets  # 400 bytes: over the cap, alone
    with pytest.raises(ValueError):
        plan_buckets(named, 0)


def test_flatten_cache_reflects_new_values_and_new_storage():
    from services.common import weight_wire
    from services.trainer.weight_sync.buckets import FlattenCache
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4)
    cache = FlattenCache()
    flat1, meta1 = cache.flatten([("a", a), ("b", b)], "bytes")
    a.add_(10)  # in place, as the optimiser does: the cached views see it
    flat2, meta2 = cache.flatten([("a", a), ("b", b)], "bytes")
    assert meta2 is meta1
    got = dict(weight_wire.unflatten_bucket(flat2, meta2))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert not torch.equal(flat1, flat2) and flat2.data_ptr() != flat1.data_ptr()
    a2 = a.clone()  # new storage: a cache miss, still right
    flat3, meta3 = cache.flatten([("a", a2), ("b", b)], "bytes")
    assert torch.equal(dict(weight_wire.unflatten_bucket(flat3, meta3))["a"], a2)


def test_flatten_cache_shared_memory_bucket():
    from services.common import weight_wire
    from services.trainer.weight_sync.buckets import FlattenCache
    weight_wire.use_cpu_shared_memory()
    a, b = torch.randn(3, 4), torch.randn(5)
    cache = FlattenCache()
    for _ in range(2):  # miss, then hit
        flat, meta = cache.flatten([("a", a), ("b", b)], "bytes", shared=True)
        assert flat.is_shared()
        got = dict(weight_wire.unflatten_bucket(flat, meta))
        assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
