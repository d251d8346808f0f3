"""Engine internals behind a fast weight update and faithful log-probs: the fp32 vocabulary
projection, the remembered parameter match of a repeated payload, and multi-tensor copies."""
from __future__ import annotations

import torch

from services.common import weight_wire
from services.engine import weights
from services.engine.model import ModelRunner, load_model
from tests.engine.conftest import tiny_llama


def tiny_runner(dtype=torch.bfloat16) -> ModelRunner:
    return ModelRunner(tiny_llama().to(dtype), max_slots=4, initial_capacity=8)


def test_fp32_lm_head_logits_are_not_rounded():
    runner = tiny_runner()
    h = (torch.randn(3, 32) * 8).bfloat16()
    stock = runner.logits(h)
    assert torch.equal(stock, runner.lm_head(h).float())
    runner.fp32_lm_head = True
    exact = runner.logits(h)
    want = h.float() @ runner.lm_head.weight.float().t()
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-4)
    assert not torch.equal(exact, stock)  # stock logits are bf16-rounded


def test_held_views_are_matched_once_others_every_time_and_apply_copies_all():
    runner = tiny_runner(torch.float32)
    named = [(n, torch.full_like(p, 0.5)) for n, p in runner.named_parameters().items()]
    # A payload list that is not a held CUDA buffer's views (a CPU payload): matched anew each time,
    # nothing kept that would hold its shared memory.
    assert weights.check(runner, named) is not weights.check(runner, named)
    # A held buffer's views list (what IpcMappings hands out again for a reused CUDA buffer).
    mappings = weights.IpcMappings()
    mappings._held[1] = weights._Held(torch.UntypedStorage(1), sig="layout", named=named)
    pairs = mappings.matched(named, runner, weights._match)
    assert mappings.matched(named, runner, weights._match) is pairs
    assert mappings.matched(list(named), runner, weights._match) is not pairs
    assert weights.apply(pairs) == len(named)
    for n, p in runner.named_parameters().items():
        assert torch.all(p == 0.5), n


def test_unflatten_of_cpu_buckets_is_not_held():
    flat, meta = weight_wire.flatten_bucket([("a", torch.ones(2, 3)), ("b", torch.zeros(4))])
    before = len(weights.IPC_MAPPINGS)
    got = dict(weights.IPC_MAPPINGS.unflatten(flat, meta))
    assert torch.equal(got["a"], torch.ones(2, 3)) and torch.equal(got["b"], torch.zeros(4))
    assert len(weights.IPC_MAPPINGS) == before  # shared-memory segments are new each sync


def test_dummy_load_format_reads_only_the_config(tmp_path):
    tiny_llama(layers=1).config.save_pretrained(tmp_path)
    model = load_model(tmp_path, torch.device("cpu"), torch.bfloat16, "dummy")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 1
