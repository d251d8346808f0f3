"""/generate against the real engine: HF-exact greedy output, SGLang reply shape, logprobs, sampling, batching."""
import asyncio

import httpx
import pytest
import torch

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_logprobs(model, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


async def test_info_endpoints(client, engine_url):
    info = await client.model_info()
    assert info["model_path"].endswith("SmolLM2-135M-Instruct")
    assert info["dtype"] == "float32" and info["weight_version"]
    async with httpx.AsyncClient(base_url=engine_url) as http:
        for path in ("/get_model_info", "/server_info", "/get_server_info"):
            assert (await http.get(path)).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/health_generate")).status_code == 200
    assert (await client.server_info())["max_running_requests"] == 16
    assert await client.health()


async def test_greedy_matches_transformers_and_reply_shape(client, hf_model, prompt):
    reply = await client.generate(prompt, GREEDY, return_logprob=True)
    assert reply["output_ids"] == _hf_greedy(hf_model, prompt, 8)
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 8
    assert meta["weight_version"] and meta["id"] and meta["input_token_logprobs"] == []
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == reply["output_ids"] and all(e[2] is None for e in lps)
    ref = _hf_logprobs(hf_model, prompt + reply["output_ids"])
    for i, (lp, tok, _) in enumerate(lps):
        assert lp == pytest.approx(ref[len(prompt) - 1 + i, tok].item(), abs=1e-3)


async def test_input_logprobs(client, hf_model, prompt):
    reply = await client.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                                  logprob_start_len=0)
    inp = reply["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt and inp[0][0] is None
    ref = _hf_logprobs(hf_model, prompt)
    for i in range(1, len(prompt)):
        assert inp[i][0] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-3)
    tail = await client.generate(prompt, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=3)
    assert [e[1] for e in tail["meta_info"]["input_token_logprobs"]] == prompt[3:]


async def test_sampled_logprobs_are_of_the_tempered_distribution(client, hf_model, prompt):
    params = {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "sampling_seed": 11}
    reply = await client.generate(prompt, params, return_logprob=True)
    ref = _hf_logprobs(hf_model, prompt + reply["output_ids"], temperature=0.7)
    for i, (lp, tok, _) in enumerate(reply["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(ref[len(prompt) - 1 + i, tok].item(), abs=1e-3)
        # the token came from the truncated set: within the top 20 of the tempered distribution
        assert tok in ref[len(prompt) - 1 + i].topk(20).indices.tolist()


async def test_seeded_sampling_is_reproducible(client, prompt):
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234}
    first, second = await asyncio.gather(client.generate(prompt, params), client.generate(prompt, params))
    assert first["output_ids"] == second["output_ids"]
    other = await client.generate(prompt, {**params, "sampling_seed": 99})
    assert other["output_ids"] != first["output_ids"]


async def test_n_and_batched_input(client, prompt):
    many = await client.generate(prompt, {"max_new_tokens": 3, "n": 3, "temperature": 1.0})
    assert isinstance(many, list) and len(many) == 3
    assert len({r["meta_info"]["id"] for r in many}) == 3
    batch = await client.generate([prompt, prompt[:3]], GREEDY)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[1]["meta_info"]["prompt_tokens"] == 3
    solo = await client.generate(prompt, GREEDY)
    assert batch[0]["output_ids"] == solo["output_ids"]


async def test_concurrent_requests_share_forward_passes(client, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("Once upon a time", "def add(a, b):", "Paris is", "1, 2, 3,",
                                             "The weather today", "import numpy", "Dear John,", "Q: why?")]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    solo = [await client.generate(p, params) for p in prompts]
    before = (await client.server_info())["internal_states"][0]["forward_steps"]
    together = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    steps = (await client.server_info())["internal_states"][0]["forward_steps"] - before
    assert [r["output_ids"] for r in together] == [r["output_ids"] for r in solo]
    assert steps < 8 * 10 / 2  # 80 tokens in far fewer forward passes: they were batched


async def test_stop_conditions(client, prompt, tokenizer):
    free = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    ids = free["output_ids"]
    by_id = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [ids[2]]},
                                  return_logprob=True)
    assert by_id["output_ids"] == ids[:3]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert len(by_id["meta_info"]["output_token_logprobs"]) == 3
    word = tokenizer.decode(ids[3:5]).strip()
    by_str = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop": [word]})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in by_str["text"] and len(by_str["output_ids"]) <= 5
    kept = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop": word, "no_stop_trim": True})
    assert kept["text"].endswith(word) or word in kept["text"]


async def test_eos_is_included_in_ids_not_text(client, tokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    reply = await client.generate(chat, {"max_new_tokens": 48, "temperature": 0, "skip_special_tokens": False})
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert reply["output_ids"][-1] == 2 and "<|im_end|>" not in reply["text"]
    ignored = await client.generate(chat, {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
    assert ignored["meta_info"]["finish_reason"]["type"] == "length" and len(ignored["output_ids"]) == 48


@pytest.mark.parametrize("body, reason", [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokenz": 3}}, "unknown sampling_params key"),
    ({"input_ids": [1, "2"]}, "non-integer"),
    ({"input_ids": [1, 2.5]}, "non-integer"),
    ({"input_ids": [1, 49152]}, "outside the vocabulary"),
    ({"input_ids": [-1]}, "outside the vocabulary"),
    ({"input_ids": [1] * 8192}, "longer than the model's context length"),
    ({"input_ids": []}, "non-empty"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1], "text": "x"}, "exactly one"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "entries"),
])
async def test_bad_generate_requests_get_400(engine_url, body, reason):
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        resp = await http.post("/generate", json=body)
        assert resp.status_code == 400, resp.text
        assert reason in resp.json()["error"]["message"]
        assert (await http.get("/health_generate")).status_code == 200


async def test_malformed_json_gets_400(engine_url):
    async with httpx.AsyncClient(base_url=engine_url) as http:
        resp = await http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
