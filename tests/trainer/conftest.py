"""Shared fixtures of the trainer tests: a tiny Llama policy and batches for it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.trainer.batch import EpisodeArrays
from services.trainer.model import enable_checkpointing

VOCAB = 128


def tiny_model(seed: int = 0, tie: bool = True) -> LlamaForCausalLM:
    """A 2-layer Llama small enough for CPU tests, checkpointing on like the real trainer."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    enable_checkpointing(model)
    model.train()
    return model


def random_episodes(n: int, seed: int = 0, max_prompt: int = 10, max_resp: int = 12) -> list[EpisodeArrays]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(1, max_prompt)), int(rng.integers(1, max_resp))
        mask = rng.random(r) > 0.25
        mask[0] = True
        lp = np.where(mask, -rng.random(r) * 6, 0).astype(np.float32)
        out.append(EpisodeArrays(prompt_ids=rng.integers(1, VOCAB, p), response_ids=rng.integers(1, VOCAB, r),
                                 loss_mask=mask, rollout_logprobs=lp, advantage=float(rng.normal()),
                                 policy_version=0, weight=1.0))
    return out


@pytest.fixture
def model():
    return tiny_model()
