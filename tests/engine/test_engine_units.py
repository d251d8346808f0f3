"""Units of the engine: sampling-parameter validation, batched sampling, and the slot-cache forward vs transformers."""
import pytest
import torch

from services.engine.model import ModelRunner
from tests.engine.conftest import tiny_llama
from services.engine.sampling import BatchSampling, SamplingParams, parse_sampling_params, sample, seeded_uniform


def test_parse_defaults_and_errors():
    p = parse_sampling_params({"stop": "x", "temperature": 0, "stop_token_ids": [2]}, vocab_size=10)
    assert p.stop == ["x"] and p.greedy and p.stop_token_ids == {2} and p.max_new_tokens == 128
    for bad, reason in [({"nope": 1}, "unknown"), ({"stop_token_ids": [10]}, "out of vocabulary"),
                        ({"top_k": 0}, "top_k"), ({"n": 0}, "n must"), ({"frequency_penalty": 0.5}, "not supported"),
                        ({"ignore_eos": "yes"}, "true or false"), ({"max_new_tokens": 1.5}, "integer")]:
        with pytest.raises(ValueError, match=reason):
            parse_sampling_params(bad, vocab_size=10)
    assert parse_sampling_params({"frequency_penalty": 0.0, "regex": None}, 10).n == 1


def test_seeded_noise_is_deterministic_and_uniform():
    seeds, pos = torch.tensor([7, 7, 8]), torch.tensor([3, 3, 3])
    u = seeded_uniform(seeds, pos, 50_000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


def _settings(params, vocab):
    return BatchSampling.build(params, [0] * len(params), vocab, torch.device("cpu"))


def test_sample_greedy_topk_and_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2, sampling_seed=1), SamplingParams(temperature=2.0)]
    counts = torch.zeros(4)
    for seed in range(300):
        params[1].sampling_seed = seed
        tokens, lps = sample(logits, _settings(params, 4))
        assert tokens[0] == 0 and tokens[1] in (0, 1)
        counts[tokens[2]] += 1
        assert lps[2].item() == pytest.approx(torch.log_softmax(logits[2] / 2.0, -1)[tokens[2]].item(), abs=1e-6)
    assert (counts > 0).all()  # T=2 without truncation reaches every token


def test_slot_cache_forward_matches_transformers():
    model = tiny_llama()
    runner = ModelRunner(model, max_slots=8, initial_capacity=4)
    a, b = [1, 5, 9, 3, 7], [2, 4]
    hidden = runner.prefill([5, 2], [a, b])  # non-contiguous slots, cache grows in both dimensions
    seqs = {5: a + [11], 2: b + [12]}
    with torch.no_grad():
        assert torch.allclose(runner.logits(hidden[0, :5]), model(torch.tensor([a])).logits[0], atol=1e-5)
        for step in range(6):
            slots = [2, 5]
            logits = runner.decode(slots, [seqs[s][-1] for s in slots], [len(seqs[s]) - 1 for s in slots])
            for i, s in enumerate(slots):
                ref = model(torch.tensor([seqs[s]])).logits[0, -1]
                assert torch.allclose(logits[i], ref, atol=1e-4)
                seqs[s].append(int(ref.argmax()))
    assert runner.capacity >= 12 and runner.slot_capacity >= 6


def test_padded_bucket_decode_matches_eager():
    """The CUDA-graph step's layout (rows = slots [0, B), padding rows, length buckets), run without graphs."""
    from services.engine.cuda_graphs import GraphDecoder
    model = tiny_llama(max_positions=256)
    eager = ModelRunner(model, max_slots=8, initial_capacity=128)
    bucketed = ModelRunner(model, max_slots=8, initial_capacity=128)
    bucketed.graphs = GraphDecoder(bucketed, min_len=16, capture=False)
    prompts = {1: [3, 4, 5], 4: [9, 8, 7, 6, 5, 4], 6: [1]}
    for r in (eager, bucketed):
        r.prefill(list(prompts), list(prompts.values()))
    seqs = {s: p + [2] for s, p in prompts.items()}
    for _ in range(20):  # crosses the 16-position bucket
        slots = [6, 1, 4]
        args = (slots, [seqs[s][-1] for s in slots], [len(seqs[s]) - 1 for s in slots])
        a, b = eager.decode(*args), bucketed.decode(*args)
        assert torch.allclose(a, b, atol=1e-5)
        for i, s in enumerate(slots):
            seqs[s].append(int(a[i].argmax()))
