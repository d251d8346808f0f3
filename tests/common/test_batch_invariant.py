"""Batch-invariant numerics: the engine's cached decode and the trainer's full pass give the same log-probs.

On CPU (fp32, torch formulas) the two forwards must agree with each other and with the stock HF forward,
gradients included. The Triton kernels are checked against the torch formulas in Triton's interpreter
when triton is installed, and on a GPU the engine's log-probs must equal the trainer's bit for bit,
however the decode batch is composed.
"""
from __future__ import annotations

import copy
import importlib.util
import math
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from services.common import batch_invariant as bi
from services.engine.model import ModelRunner
from services.trainer.logprobs import PolicyModel, pack_sequences
from services.trainer.model import enable_checkpointing

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny(arch: str = "llama", dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SHAPE, head_dim=16)).to(device, dtype)
    model.config.use_cache = False
    with torch.no_grad():  # visible norm weights and biases, so a mix-up between them shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def episodes(seed: int = 1, n: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, SHAPE["vocab_size"], (int(torch.randint(3, 40, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(1, SHAPE["vocab_size"], (int(torch.randint(2, 30, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(n)]
    return prompts, responses


def engine_logprobs(runner: ModelRunner, prompts, responses, temperature: float = 1.0) -> list[torch.Tensor]:
    """Teacher-forced engine path: one batched prefill, then decode steps whose batch shrinks as
    responses end (so rows move between the contiguous and the gathered decode paths)."""
    runner.reset_cache()
    n = len(prompts)
    hidden = runner.prefill(list(range(n)), prompts)
    last = torch.stack([hidden[i, len(p) - 1] for i, p in enumerate(prompts)])
    lp = torch.log_softmax(runner.logits(last) / temperature, dim=-1)
    out = [[lp[i, r[0]]] for i, r in enumerate(responses)]
    step = 0
    while live := [i for i in range(n) if step + 1 < len(responses[i])]:
        logits = runner.decode(live, [responses[i][step] for i in live], [len(prompts[i]) + step for i in live])
        lp = torch.log_softmax(logits / temperature, dim=-1)
        for j, i in enumerate(live):
            out[i].append(lp[j, responses[i][step + 1]])
        step += 1
    return [torch.stack(x).float().cpu() for x in out]


def trainer_logprobs(policy: PolicyModel, prompts, responses, temperature: float = 1.0, grad: bool = False):
    device = next(policy.parameters()).device
    packed = pack_sequences(prompts, responses, pad_id=0, device=device)
    with torch.set_grad_enabled(grad):
        lp, _ = policy(packed.input_ids, packed.gather_index, packed.targets, temperature=temperature)
    return lp, list(torch.split(lp.detach().float().cpu(), packed.response_lens))


def runner_for(model, invariant: bool, fp32_head: bool = False, cuda_graph: bool = False) -> ModelRunner:
    runner = ModelRunner(copy.deepcopy(model).eval(), max_slots=8, cuda_graph=cuda_graph)
    runner.batch_invariant = invariant
    runner.fp32_lm_head = fp32_head
    return runner


@pytest.mark.parametrize("arch", list(ARCHS))
def test_invariant_trainer_forward_matches_hf_forward_and_gradients(arch):
    model = tiny(arch)
    enable_checkpointing(model)
    model.train()
    prompts, responses = episodes()
    stock = PolicyModel(model)
    invariant = PolicyModel(model, batch_invariant=True)
    assert invariant.checkpoint_layers
    grads = []
    for policy in (stock, invariant):
        model.zero_grad()
        lp, per_seq = trainer_logprobs(policy, prompts, responses, temperature=0.7, grad=True)
        (lp * torch.linspace(-1, 1, lp.numel())).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if policy is stock:
            reference = per_seq
    for a, b in zip(reference, per_seq):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_invariant_engine_decode_matches_trainer_on_cpu(arch):
    model = tiny(arch)
    prompts, responses = episodes(seed=2)
    _, mine = trainer_logprobs(PolicyModel(model, batch_invariant=True), prompts, responses, temperature=0.8)
    theirs = engine_logprobs(runner_for(model, invariant=True), prompts, responses, temperature=0.8)
    stock = engine_logprobs(runner_for(model, invariant=False), prompts, responses, temperature=0.8)
    for a, b, c in zip(mine, theirs, stock):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=2e-5, rtol=1e-5)


def test_engine_flag_turns_the_runner_invariant_and_is_reported(tmp_path):
    from services.engine.engine import Engine, EngineConfig
    tiny("qwen2").save_pretrained(tmp_path)
    engine = Engine.load(EngineConfig(model=str(tmp_path), deterministic_inference=True))
    assert engine.runner.batch_invariant
    info = engine.server_info()
    assert info["enable_deterministic_inference"] is True and info["enable_fp32_lm_head"] is False
    assert Engine.load(EngineConfig(model=str(tmp_path))).server_info()["enable_deterministic_inference"] is False


def test_attention_cache_form_equals_whole_sequence_form():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    whole = bi.attention(q, k, v, 0.25)
    cache_k, cache_v = torch.zeros(3, 2, 12, 16), torch.zeros(3, 2, 12, 16)
    cache_k[[2, 0], :, :9], cache_v[[2, 0], :, :9] = k, v
    pos = torch.tensor([5, 8])
    one = bi.attention(torch.stack([q[0, :, 5:6], q[1, :, 8:9]]), cache_k, cache_v, 0.25, positions=pos,
                       kv_rows=torch.tensor([2, 0]), kv_len=12)
    torch.testing.assert_close(one[:, 0], torch.stack([whole[0, 5], whole[1, 8]]))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs on CPU)")
def test_kernels_in_triton_interpreter():
    """The kernels' indexing and masking against the torch formulas, run by Triton's CPU interpreter."""
    code = r'''
import math, torch
from services.common import batch_invariant as bi, batch_invariant_kernels as K
torch.manual_seed(0)
dt = torch.float16
a, w, b = torch.randn(70, 96, dtype=dt), torch.randn(130, 96, dtype=dt), torch.randn(130, dtype=dt)
ref = a.float() @ w.float().t() + b.float()
assert (K.matmul(a, w, b, torch.float32) - ref).abs().max() < 1e-3
assert torch.equal(K.matmul(a[5:6], w, b, torch.float32)[0], K.matmul(a, w, b, torch.float32)[5])
x, nw = torch.randn(5, 100, dtype=dt) * 3, torch.randn(100, dtype=dt)
assert torch.equal(K.rms_norm(x, nw, 1e-5), bi.reference_rms_norm(x, nw, 1e-5))
q, k, v = torch.randn(2, 6, 37, 16, dtype=dt), torch.randn(2, 2, 37, 16, dtype=dt), torch.randn(2, 2, 37, 16, dtype=dt)
zeros, rows = torch.zeros(2, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
whole = K.attention(q, k, v, zeros, rows, 37, 0.25)
assert (whole.float() - bi.reference_attention(q.float(), k.float(), v.float(), 0.25)).abs().max() < 2e-3
ck, cv = torch.randn(3, 2, 50, 16, dtype=dt), torch.randn(3, 2, 50, 16, dtype=dt)
ck[[2, 0], :, :37], cv[[2, 0], :, :37] = k, v
one = K.attention(torch.stack([q[0, :, 36:37], q[1, :, 20:21]]), ck, cv, torch.tensor([36, 20], dtype=torch.int32),
                  torch.tensor([2, 0], dtype=torch.int32), 45, 0.25)
assert torch.equal(one[0, 0], whole[0, 36]) and torch.equal(one[1, 0], whole[1, 20])
print("ok")
'''
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ---- GPU: bitwise -------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not bi.kernels_available("cuda"),
                               reason="needs CUDA and triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("arch,fp32_head,graphs", [(a, h, False) for a in ARCHS for h in (True, False)]
                         + [("llama", True, True)])
def test_engine_logprobs_equal_trainer_logprobs_bitwise_on_gpu(arch, fp32_head, graphs):
    """Decode batches shrink as responses end, and CUDA graphs pad them: no row may notice."""
    model = tiny(arch, torch.bfloat16, "cuda:0")
    enable_checkpointing(model)
    prompts, responses = episodes(seed=3, n=6)
    _, mine = trainer_logprobs(PolicyModel(model, fp32_head=fp32_head, batch_invariant=True), prompts, responses)
    runner = runner_for(model, invariant=True, fp32_head=fp32_head, cuda_graph=graphs)
    assert runner.decode_mode == ("cuda_graph" if graphs else "eager")
    theirs = engine_logprobs(runner, prompts, responses)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.gpu
@needs_gpu
def test_kernels_against_torch_on_gpu():
    torch.manual_seed(0)
    dt = torch.bfloat16
    a, w = torch.randn(300, 192, dtype=dt, device="cuda"), torch.randn(200, 192, dtype=dt, device="cuda")
    full = bi.linear(a, w)
    torch.testing.assert_close(full.float(), a.float() @ w.float().t(), atol=0.05, rtol=0.02)
    for m in (1, 3, 64, 65):  # a row's result does not depend on how many rows come with it
        assert torch.equal(bi.linear(a[7: 7 + m], w)[0], full[7])
    q = torch.randn(3, 8, 130, 64, dtype=dt, device="cuda")
    k, v = torch.randn(3, 2, 130, 64, dtype=dt, device="cuda"), torch.randn(3, 2, 130, 64, dtype=dt, device="cuda")
    out = bi.attention(q, k, v, 1 / math.sqrt(64))
    ref = bi.reference_attention(q.float(), k.float(), v.float(), 1 / math.sqrt(64))
    torch.testing.assert_close(out.float(), ref, atol=0.02, rtol=0.02)
