"""GPU-only: CUDA-graph decode equals eager decode, and CUDA-IPC weight updates (GPU UUID mapping) into a served engine."""
import asyncio
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from services.common.net import free_port as _free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _small_qwen(dtype=torch.float32, device="cuda:0"):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).to(dtype).eval()


# cuda:1 while cuda:0 is the current device: graph capture must follow the engine's card.
@pytest.mark.parametrize("device", ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])
def test_graph_decode_matches_eager(device):
    previous = torch.cuda.current_device()
    torch.cuda.set_device(device)  # as the engine's scheduler thread does
    try:
        _check_graph_decode(device)
    finally:
        torch.cuda.set_device(previous)


def _check_graph_decode(device):
    from services.engine.model import ModelRunner
    model = _small_qwen(device=device)
    graph = ModelRunner(model, max_slots=8, cuda_graph=True, graph_max_len=512)
    eager = ModelRunner(model, max_slots=8, cuda_graph=False)
    prompts = {0: list(range(5, 40)), 3: [7, 8, 9], 5: list(range(100, 190))}
    for r in (graph, eager):
        r.prefill(list(prompts), list(prompts.values()))
    seqs = {s: p + [1] for s, p in prompts.items()}
    for _ in range(50):
        slots = sorted(seqs)
        args = (slots, [seqs[s][-1] for s in slots], [len(seqs[s]) - 1 for s in slots])
        a, b = eager.decode(*args), graph.decode(*args)
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()
        for i, s in enumerate(slots):
            seqs[s].append(int(a[i].argmax()))
    if torch.device(device).index == 0:
        assert graph.decode_mode == "cuda_graph" and not graph.graphs.failed and graph.graphs.graphs
    else:  # graphs are refused off device 0 (they replayed wrong logits there): eager, and right
        assert graph.decode_mode != "cuda_graph" and graph.graphs is None


def test_cuda_ipc_update_into_served_engine(tmp_path):
    asyncio.run(_cuda_ipc_update(tmp_path))


async def _cuda_ipc_update(tmp_path):
    from services.common import weight_wire as ww
    from services.common.sglang_client import SGLangClient
    model = _small_qwen(torch.bfloat16)
    model.save_pretrained(tmp_path)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--model", str(tmp_path), "--device", "cuda:0",
                             "--port", str(port), "--max-running-requests", "8"], cwd=ROOT, env=env)
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}") as client:
            await client.wait_ready(180)
            info = await client.server_info()
            assert info["decode_mode"] == "cuda_graph" and (await client.model_info())["dtype"] == "bfloat16"
            params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
            before = await client.generate(list(range(3, 30)), params, return_logprob=True)
            assert len(before["meta_info"]["output_token_logprobs"]) == 16
            ww.enable_cuda_uuid_mapping()
            named = [(k, torch.randn_like(v) * 0.05) for k, v in original.items()]
            flat, meta = ww.flatten_bucket(named)
            data = ww.serialize(ww.bucket_payload(flat, meta))
            assert str(torch.cuda.get_device_properties(0).uuid).encode() in __import__("base64").b64decode(data)
            await client.update_weights_from_tensor([data], load_format="flattened_bucket", weight_version="s")
            torch.cuda.ipc_collect()
            scrambled = await client.generate(list(range(3, 30)), params)
            assert scrambled["output_ids"] != before["output_ids"]
            await client.update_weights_from_tensor([ww.serialize(list(original.items()))], weight_version="r")
            after = await client.generate(list(range(3, 30)), params)
            assert after["output_ids"] == before["output_ids"]
            # concurrency on the graph path: 8 requests at once match their solo runs (bf16 kernels of another
            # batch size may flip a near-tie, so most, not all, must be identical)
            prompts = [list(range(i + 3, i + 20)) for i in range(8)]
            solo = [(await client.generate(p, params))["output_ids"] for p in prompts]
            together = await asyncio.gather(*(client.generate(p, params) for p in prompts))
            assert all(len(r["output_ids"]) == 16 for r in together)
            assert sum(r["output_ids"] == s for r, s in zip(together, solo)) >= 6
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_overlapped_graph_scheduler_matches_synchronous():
    """The GPU default (step N+1 launched before step N is read, tokens fed from the device into the graph
    inputs, pinned copies and events) gives what the one-step-at-a-time scheduler gives, in fp32."""
    from services.engine.model import ModelRunner
    from services.engine.sampling import SamplingParams
    from services.engine.scheduler import Scheduler, Sequence
    model = _small_qwen()
    runner = ModelRunner(model, max_slots=8, cuda_graph=True, graph_max_len=512)

    def run(overlap, eos):
        seqs = [Sequence(rid=str(i), prompt=list(range(5 + i, 30 + 7 * i)),
                         params=SamplingParams(max_new_tokens=20 + 5 * i, temperature=0.0 if i % 3 else 1.0,
                                               sampling_seed=i)) for i in range(6)]
        sched = Scheduler(runner, eos_ids=set(eos), detokenize=lambda ids, p: "", overlap=overlap)
        sched.start()
        try:
            sched.submit(seqs)
            for s in seqs:
                s.future.result(timeout=120)
        finally:
            sched.stop()
        return seqs
    first = run(False, ())
    eos = {first[1].output_ids[4]}
    plain, overlapped = run(False, eos), run(True, eos)
    assert runner.decode_mode == "cuda_graph" and not runner.graphs.failed
    for a, b in zip(plain, overlapped):
        assert (b.output_ids, b.finish) == (a.output_ids, a.finish)
        assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-3)
