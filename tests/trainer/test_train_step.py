"""TrainStep over gRPC: a good batch trains, every kind of bad batch is refused and changes nothing."""
from __future__ import annotations

import grpc
import pytest
import torch

from services.common.grpc_server import ServiceServer, channel
from services.common.packing import pack, pack_floats, pack_ids
from services.common.proto.rlyard.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.trainer.losses import LossSettings
from services.trainer.servicer import TrainerServicer
from services.trainer.trainer import PolicyTrainer, TrainerSettings
from services.trainer.weight_sync import WeightSyncer
from tests.trainer.conftest import VOCAB, tiny_model


@pytest.fixture
async def served():
    trainer = PolicyTrainer(tiny_model(), "cpu", TrainerSettings(lr=1e-2, micro_batch_tokens=24,
                                                                 loss=LossSettings(lr=1e-2)))
    server, syncer = ServiceServer("127.0.0.1", 0), WeightSyncer()
    server.add(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(trainer, syncer),
               "rlyard.v1.Trainer")
    port = await server.start()
    async with channel(f"127.0.0.1:{port}") as ch:
        yield trainer, trainer_pb2_grpc.TrainerStub(ch)
    await server.stop(0)
    await syncer.aclose()  # its engine clients hold HTTP sessions


def episode(**over):
    fields = dict(prompt_ids=pack_ids([1, 2, 3]), response_ids=pack_ids([4, 5, 6, 7]),
                  loss_mask=pack_ids([1, 1, 0, 1]), rollout_logprobs=pack_floats([-4.0, -5.0, 0.0, -4.5]),
                  advantage=1.0)
    fields.update(over)
    return trainer_pb2.Episode(**fields)


def stream(episodes, **header):
    header.setdefault("num_episodes", len(episodes))
    yield trainer_pb2.TrainStepChunk(header=trainer_pb2.StepHeader(**header))
    for e in episodes:
        yield trainer_pb2.TrainStepChunk(episode=e)


def snapshot(trainer):
    return {n: p.detach().clone() for n, p in trainer.lm.named_parameters()}


async def test_good_step_trains_and_reports_metrics(served):
    trainer, stub = served
    before = snapshot(trainer)
    eps = [episode(advantage=1.0), episode(advantage=-1.0, response_ids=pack_ids([8, 9, 10, 11])),
           episode(prompt_ids=pack_ids(list(range(1, 20))), advantage=0.5)]
    reply = await stub.TrainStep(stream(eps, expected_policy_version=0, step_id="t/1"))
    assert reply.step == 1 and reply.policy_version == 1
    m = reply.metrics
    for key in ("loss", "clip_frac", "dual_clip_frac", "entropy", "grad_norm", "kl", "logprob_diff_mean",
                "logprob_diff_max", "tokens", "step_s", "peak_memory_gb"):
        assert key in m, key
    assert m["tokens"] == 9 and m["micro_batches"] >= 2  # 24-token budget splits the batch
    assert m["grad_norm"] > 0 and m["logprob_diff_max"] >= m["logprob_diff_mean"] > 0
    after = snapshot(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    status = await stub.GetStatus(common_pb2.Empty())
    assert status.step == 1 and status.device == "cpu" and status.num_parameters > 0


BAD = [
    ("unequal lengths", [episode(loss_mask=pack_ids([1, 1, 1]))], {}, grpc.StatusCode.INVALID_ARGUMENT, "same length"),
    ("mask not 0/1", [episode(loss_mask=pack_ids([1, 2, 0, 1]))], {}, grpc.StatusCode.INVALID_ARGUMENT, "only 0 and 1"),
    ("nan logprob", [episode(rollout_logprobs=pack_floats([-1, float("nan"), 0, -1]))], {},
     grpc.StatusCode.INVALID_ARGUMENT, "not finite"),
    ("positive logprob", [episode(rollout_logprobs=pack_floats([-1, 2.0, 0, -1]))], {},
     grpc.StatusCode.INVALID_ARGUMENT, "<= 0"),
    ("inf advantage", [episode(advantage=float("inf"))], {}, grpc.StatusCode.INVALID_ARGUMENT, "advantage"),
    ("id outside vocab", [episode(response_ids=pack_ids([4, VOCAB, 6, 7]))], {},
     grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    ("negative id", [episode(prompt_ids=pack_ids([-1, 2]))], {}, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ("too long", [episode(prompt_ids=pack_ids([1] * 70))], {}, grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ("empty prompt", [episode(prompt_ids=pack_ids([]))], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids is empty"),
    ("float ids", [episode(prompt_ids=pack([1.0, 2.0], "float32"))], {}, grpc.StatusCode.INVALID_ARGUMENT, "int32"),
    ("count mismatch", [episode()], {"num_episodes": 2}, grpc.StatusCode.INVALID_ARGUMENT, "announced 2"),
    ("nothing masked", [episode(loss_mask=pack_ids([0, 0, 0, 0]))], {}, grpc.StatusCode.INVALID_ARGUMENT,
     "nothing to train"),
    ("stale trainer", [episode()], {"expected_policy_version": 7}, grpc.StatusCode.FAILED_PRECONDITION,
     "expected_policy_version 7"),
    ("future episode", [episode(policy_version=3)], {}, grpc.StatusCode.FAILED_PRECONDITION, "newer"),
    ("bad loss config", [episode()], {"loss": trainer_pb2.LossConfig(dual_clip_c=0.5)},
     grpc.StatusCode.INVALID_ARGUMENT, "dual_clip_c"),
    ("kl without reference", [episode()], {"loss": trainer_pb2.LossConfig(kl_coef=0.1)},
     grpc.StatusCode.FAILED_PRECONDITION, "--kl-reference"),
]


@pytest.mark.parametrize("name,eps,header,code,words", BAD, ids=[b[0] for b in BAD])
async def test_bad_batch_rejected_model_untouched(served, name, eps, header, code, words):
    trainer, stub = served
    before = snapshot(trainer)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.TrainStep(stream(eps, **header))
    assert err.value.code() == code
    assert words in err.value.details()
    assert trainer.step == 0
    after = snapshot(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


async def test_episode_before_header_rejected(served):
    _, stub = served

    def chunks():
        yield trainer_pb2.TrainStepChunk(episode=episode())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.TrainStep(chunks())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "StepHeader" in err.value.details()


async def test_sync_bad_requests(served):
    _, stub = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SyncWeights(trainer_pb2.SyncWeightsRequest(engine_urls=[], method="ipc"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SyncWeights(trainer_pb2.SyncWeightsRequest(engine_urls=["http://127.0.0.1:1"], method="smoke"))
    assert "unknown sync method" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:  # nobody listens on port 1
        await stub.SyncWeights(trainer_pb2.SyncWeightsRequest(engine_urls=["http://127.0.0.1:1"], method="disk"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
