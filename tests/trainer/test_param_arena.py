"""ParamArena: parameters packed into flat per-dtype buffers stay correct through training, and its
buckets are exactly what flattening would have produced."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.common import weight_wire
from services.trainer.batch import EpisodeArrays
from services.trainer.losses import LossSettings
from services.trainer.param_arena import ParamArena
from services.trainer.trainer import PolicyTrainer, TrainerSettings
from services.trainer.weight_sync.buckets import plan_buckets


def tiny_model(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_pack_keeps_values_and_makes_views():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    arena = ParamArena.pack(model)
    flat = arena.flats[torch.float32]
    assert flat.numel() == sum(v.numel() for v in values.values())
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * 4
    for n, p in model.named_parameters():
        assert lo <= p.data_ptr() < hi, n
        assert torch.equal(p.detach(), values[n])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert arena.intact()


@pytest.mark.parametrize("layout", ["bytes", "elements"])
def test_buckets_equal_flattened_tensors(layout):
    model = tiny_model(tied=False)
    arena = ParamArena.pack(model)
    named = arena.named_tensors()
    plan = plan_buckets(named, cap_bytes=20_000)
    assert len(plan) > 2
    for idx, (view, meta) in zip(plan, arena.buckets(plan, layout)):
        want, want_meta = weight_wire.flatten_bucket([named[i] for i in idx], layout)
        assert torch.equal(view, want)
        assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in meta] == \
               [(m.name, m.start_idx, m.end_idx, m.numel) for m in want_meta]
        assert dict(weight_wire.unflatten_bucket(view, meta)).keys() == {named[i][0] for i in idx}


def test_training_writes_into_the_arena_and_buckets_follow():
    model = tiny_model()
    tr = PolicyTrainer(model, "cpu", TrainerSettings(lr=1e-2))
    arena = tr.arena
    assert arena is not None
    plan = plan_buckets(arena.named_tensors(), cap_bytes=1 << 30)
    (view, meta), = arena.buckets(plan, "bytes")
    snapshot = view.clone()
    rng = np.random.default_rng(0)
    eps = [EpisodeArrays(prompt_ids=rng.integers(0, 97, 5), response_ids=rng.integers(0, 97, 6),
                         loss_mask=np.ones(6, bool), rollout_logprobs=np.full(6, -4.0, np.float32),
                         advantage=a, policy_version=0, weight=1.0) for a in (1.0, -1.0)]
    tr.train_step(eps, LossSettings(lr=1e-2))
    assert arena.intact()
    assert not torch.equal(view, snapshot)  # the step changed the weights, in place
    got = dict(weight_wire.unflatten_bucket(view, meta))
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.detach())


def test_moving_a_parameter_breaks_intact_and_bad_models_are_refused():
    model = tiny_model()
    arena = ParamArena.pack(model)
    model.model.norm.weight.data = model.model.norm.weight.data.clone()
    assert not arena.intact()
    with pytest.raises(ValueError, match="no parameters"):
        ParamArena.pack(torch.nn.ReLU())
    with pytest.raises(ValueError, match="order"):
        named = arena.named_tensors()
        arena.buckets([[1, 0]], "bytes")  # not in arena order
    assert len(named) == len(list(model.parameters()))
