"""Weight updates on the real engine: exact round trips, every payload format, sessions, disk, gloo group, refusals."""
import asyncio
import base64
import os
import pickle
import threading

import httpx
import pytest
import torch

from services.common import weight_wire as ww
from services.common.model_store import resolve_model
from services.common.sglang_client import EngineError
from services.common.net import free_port as _free_port
from tests.engine.sglang_source import importable, tensor_bucket_module

GREEDY = {"max_new_tokens": 8, "temperature": 0}
# Most tests touch a few tensors (serialising all 540 MB each time would dominate the suite);
# the first test round-trips the whole model.
SUBSET = ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
          "model.layers.1.input_layernorm.weight"]


@pytest.fixture(autouse=True)
def _cpu_sender():
    ww.use_cpu_shared_memory()


@pytest.fixture(scope="module")
def reference(engine_url, prompt):
    """Greedy output of the served (unmodified) model."""
    return httpx.post(f"{engine_url}/generate", json={"input_ids": prompt, "sampling_params": GREEDY},
                      timeout=120).json()["output_ids"]


def _scrambled(checkpoint, seed=0, names=SUBSET):
    g = torch.Generator().manual_seed(seed)
    return [(k, torch.randn(checkpoint[k].shape, generator=g) * 0.02) for k in names]


async def _restore(client, checkpoint, version="restored", names=SUBSET):
    named = [(k, checkpoint[k]) for k in names]
    async with client.weight_update_session():
        return await client.update_weights_from_tensor([ww.serialize(named)], weight_version=version)


async def test_scramble_and_restore_round_trip_exactly(client, checkpoint, prompt):
    before = await client.generate(prompt, GREEDY, return_logprob=True)
    flat, meta = ww.flatten_bucket(_scrambled(checkpoint, names=list(checkpoint)))
    async with client.weight_update_session():
        reply = await client.update_weights_from_tensor([ww.serialize(ww.bucket_payload(flat, meta))],
                                                        load_format="flattened_bucket", weight_version="scrambled")
    assert reply["success"] is True
    scrambled = await client.generate(prompt, GREEDY)
    assert scrambled["output_ids"] != before["output_ids"]
    assert scrambled["meta_info"]["weight_version"] == "scrambled"
    assert (await client.model_info())["weight_version"] == "scrambled"
    await _restore(client, checkpoint, names=list(checkpoint))
    after = await client.generate(prompt, GREEDY, return_logprob=True)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert after["meta_info"]["weight_version"] == "restored"


async def test_client_opens_the_session_itself_when_the_server_demands_it(client, checkpoint, prompt):
    # No explicit session: the engine (strict, like 0.5.23) refuses, the client retries inside one.
    reply = await client.update_weights_from_tensor([ww.serialize([(k, checkpoint[k]) for k in SUBSET])],
                                                    weight_version="auto")
    assert reply["success"] and (await client.model_info())["weight_version"] == "auto"


async def test_session_endpoints_and_strict_refusal(engine_url, checkpoint):
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        payload = {"serialized_named_tensors": [ww.serialize([("model.norm.weight", checkpoint["model.norm.weight"])])]}
        outside = await http.post("/update_weights_from_tensor", json=payload)
        assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
        assert (await http.post("/end_weight_update", json={})).status_code == 400
        assert (await http.post("/begin_weight_update", json={"selector": "all"})).status_code == 200
        assert (await http.post("/begin_weight_update", json={"selector": "all"})).status_code == 400
        # requests arriving during the session wait for its end: a multi-bucket update stays atomic
        held = asyncio.create_task(http.post("/generate", json={"input_ids": [1, 2, 3],
                                                                "sampling_params": {"max_new_tokens": 2}}))
        inside = await http.post("/update_weights_from_tensor", json=payload)
        assert inside.status_code == 200 and inside.json()["success"] is True
        await asyncio.sleep(0.5)
        assert not held.done()
        assert (await http.post("/end_weight_update", json={})).status_code == 200
        assert (await asyncio.wait_for(held, 300)).status_code == 200


def _evil_payload():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))
    return base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()


@pytest.mark.parametrize("make, load_format, reason", [
    (lambda ck: ["%%%"], None, "base64"),
    (lambda ck: [_evil_payload()], None, "disallowed global"),
    (lambda ck: [ww.serialize([("model.nope.weight", torch.zeros(3))])], None, "unknown parameter model.nope.weight"),
    (lambda ck: [ww.serialize([("model.norm.weight", torch.zeros(7))])], None, "shape (7,)"),
    (lambda ck: [ww.serialize({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": []})],
     "flattened_bucket", "non-empty"),
    (lambda ck: [ww.serialize([(k, ck[k]) for k in SUBSET[:2]])], "flattened_bucket", "flattened_bucket payload"),
    (lambda ck: [ww.serialize([(k, ck[k]) for k in SUBSET[:2]])], "safetensors", "unsupported load_format"),
    (lambda ck: "not-a-list", None, "non-empty list"),
])
async def test_bad_updates_get_400_and_change_nothing(client, checkpoint, prompt, make, load_format, reason,
                                                     reference):
    with pytest.raises(EngineError) as err:
        async with client.weight_update_session():
            await client.update_weights_from_tensor(make(checkpoint), load_format=load_format)
    assert err.value.status == 400 and reason in str(err.value)
    assert (await client.generate(prompt, GREEDY))["output_ids"] == reference


async def test_partly_bad_update_is_not_applied(client, checkpoint, prompt, reference):
    named = _scrambled(checkpoint)[1:] + [("model.norm.weight", torch.zeros(5))]
    with pytest.raises(EngineError, match="model unchanged"):
        await client.update_weights_from_tensor([ww.serialize(named)])
    assert (await client.generate(prompt, GREEDY))["output_ids"] == reference


async def test_sglang_built_bucket_loads(client, checkpoint, prompt):
    """A bucket made by SGLang's own FlattenedTensorBucket, pickled under its class path, loads here."""
    sgl = tensor_bucket_module("0.5.23")
    before = await client.generate(prompt, GREEDY)
    bucket = sgl.FlattenedTensorBucket(named_tensors=_scrambled(checkpoint, seed=3))
    with importable(sgl):
        data = ww.serialize({"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()})
    async with client.weight_update_session():
        await client.update_weights_from_tensor([data], load_format="flattened_bucket")
    assert (await client.generate(prompt, GREEDY))["output_ids"] != before["output_ids"]
    await _restore(client, checkpoint)
    assert (await client.generate(prompt, GREEDY))["output_ids"] == before["output_ids"]


async def test_elements_layout_bucket_loads(client, checkpoint, prompt):
    before = await client.generate(prompt, GREEDY)
    flat, meta = ww.flatten_bucket([(k, checkpoint[k]) for k in SUBSET], layout="elements")
    async with client.weight_update_session():
        await client.update_weights_from_tensor([ww.serialize(ww.bucket_payload(flat, meta))],
                                                load_format="flattened_bucket", weight_version="elements")
    assert (await client.generate(prompt, GREEDY))["output_ids"] == before["output_ids"]


async def test_update_from_disk(client, prompt, checkpoint, tmp_path):
    before = await client.generate(prompt, GREEDY)
    flat, meta = ww.flatten_bucket(_scrambled(checkpoint))
    await client.update_weights_from_tensor([ww.serialize(ww.bucket_payload(flat, meta))], load_format="flattened_bucket")
    reply = await client.update_weights_from_disk(str(resolve_model()), weight_version="disk-1")
    assert reply["success"]
    after = await client.generate(prompt, GREEDY)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "disk-1"
    with pytest.raises(EngineError, match="not found"):
        await client.update_weights_from_disk(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"hidden_size": 7}')
    with pytest.raises(EngineError, match="hidden_size"):
        await client.update_weights_from_disk(str(tmp_path))


async def test_distributed_update_over_gloo(client, checkpoint, prompt):
    before = await client.generate(prompt, GREEDY)
    port = _free_port()
    with pytest.raises(EngineError, match="use backend gloo"):
        await client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g", backend="nccl")
    # this test process is the trainer: rank 0 of a 2-rank group, joined concurrently with the engine
    joined = {}
    trainer = threading.Thread(target=lambda: joined.setdefault(
        "pg", ww.join_weight_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)))
    trainer.start()
    await client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g", backend="gloo")
    trainer.join(30)
    pg = joined["pg"]
    names = ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"]
    scrambled = [torch.randn(checkpoint[n].shape) for n in names]

    async def push(tensors, version, load_format=None):
        def broadcast():
            if load_format == "flattened_bucket":
                flat, _ = ww.flatten_bucket(list(zip(names, tensors)))
                torch.distributed.broadcast(flat, src=0, group=pg)
            else:
                for t in tensors:
                    torch.distributed.broadcast(t, src=0, group=pg)
        sender = asyncio.to_thread(broadcast)
        request = client.update_weights_from_distributed(
            names, ["float32"] * len(names), [list(checkpoint[n].shape) for n in names], group_name="g",
            weight_version=version, load_format=load_format)
        reply, _ = await asyncio.gather(request, sender)
        return reply

    assert (await push(scrambled, "dist-1"))["success"]
    changed = await client.generate(prompt, GREEDY)
    assert changed["output_ids"] != before["output_ids"] and changed["meta_info"]["weight_version"] == "dist-1"
    assert (await push([checkpoint[n] for n in names], "dist-2", "flattened_bucket"))["success"]
    assert (await client.generate(prompt, GREEDY))["output_ids"] == before["output_ids"]
    await client.destroy_weights_update_group("g")
    torch.distributed.destroy_process_group(pg)
    with pytest.raises(EngineError, match="not initialised"):
        await client.update_weights_from_distributed(names, ["float32"] * 2, [[576], [576, 1536]], group_name="g")
