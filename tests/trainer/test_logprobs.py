"""Log-prob alignment ([P-1 : P+R-1]), temperature, vocabulary chunking and micro-batching."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.trainer.batch import plan_micro_batches
from services.trainer.logprobs import PolicyModel, pack_sequences
from tests.trainer.conftest import random_episodes, tiny_model


def direct_logprobs(model, prompt, response, temperature=1.0):
    """Reference: one unpadded sequence, full logits, log_softmax, shift by one."""
    ids = torch.tensor(np.concatenate([prompt, response]), dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    p = len(prompt)
    return lp[p - 1:p - 1 + len(response)].gather(-1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_chunked_logprobs_equal_direct(temperature):
    model = tiny_model()
    model.eval()
    policy = PolicyModel(model, chunk_bytes=4 * 128 * 5)  # 5 rows per chunk: many chunks
    assert policy.chunk_rows() == 16  # floor of the chunk size
    policy.chunk_bytes = 1  # force the minimum
    eps = random_episodes(5, seed=3)
    inputs = pack_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps], 0, "cpu")
    with torch.no_grad():
        lp, ent = policy(inputs.input_ids, inputs.gather_index, inputs.targets, temperature)
        for e, got in zip(eps, lp.split(inputs.response_lens)):
            want = direct_logprobs(model, e.prompt_ids, e.response_ids, temperature)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ent.shape == lp.shape and (ent > 0).all()


def test_alignment_first_response_token_predicted_by_last_prompt_token():
    model = tiny_model()
    model.eval()
    prompt, response = np.array([5, 6, 7]), np.array([9, 10])
    inputs = pack_sequences([prompt], [response], 0, "cpu")
    # the row holds prompt + response[:-1]; position P-1 (token 7) predicts response[0]
    assert inputs.input_ids[0].tolist() == [5, 6, 7, 9]
    assert inputs.gather_index.tolist() == [2, 3]
    assert inputs.targets.tolist() == [9, 10]


def test_gradients_equal_direct():
    model = tiny_model()
    eps = random_episodes(3, seed=5)
    policy = PolicyModel(model, chunk_bytes=1)
    inputs = pack_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps], 0, "cpu")
    lp, _ = policy(inputs.input_ids, inputs.gather_index, inputs.targets)
    lp.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(direct_logprobs(model, e.prompt_ids, e.response_ids).sum() for e in eps).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_micro_batches_respect_budget_and_cover_everything():
    lengths = [10, 3, 7, 20, 1, 5, 5, 9]
    groups = plan_micro_batches(lengths, 21)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 21
    assert plan_micro_batches([50], 10) == [[0]]  # longer than the budget: alone
