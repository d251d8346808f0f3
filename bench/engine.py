"""Benchmark: engine output tokens/s at concurrency 1, 8, 64 vs plain transformers `generate` (batched).

Both run in this process on the same prompts, greedy, with fixed output
lengths (ignore_eos / min_new_tokens), one after the other:
  * baseline: `model.generate` on all `c` prompts as one padded batch;
  * engine: rlyard's engine served over HTTP (uvicorn in a thread), `c`
    concurrent /generate requests through SGLangClient (continuous batching);
    by default one pooled client in a thread of this process (its CPU time
    competes with the server for the GIL), `--client process` sends them from
    a separate process with one client per stream.
Output tokens/s = c × max_new_tokens / wall time (best of --repeats); the
table adds the engine's decode steps/s and prefill passes of that best run.

    python bench/engine.py                       # CPU, SmolLM2-135M, short outputs
    python bench/engine.py --device cuda:0       # H200: Qwen2.5-0.5B shape, bf16, 128 in / 128 out
    python bench/engine.py --shape tiny --prompt-len 128 --max-new-tokens 128 --repeats 5
                                                 # scheduler-overhead proxy: 2 layers, hidden 64
Writes bench/results/engine_<device kind>.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import pathlib
import platform
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.common.sglang_client import SGLangClient  # noqa: E402
from services.common.net import free_port  # noqa: E402

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu")


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=4096)


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    if shape == "tiny":  # Python-overhead proxy: the forward costs next to nothing, scheduling dominates
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**TINY)).to(dtype)
        return model.eval(), "tiny Llama (2 layers, hidden 64, vocab 4096), random weights"
    if shape == "qwen2.5-0.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(**QWEN_05B)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).to(dtype)
        return model.eval(), "Qwen2.5-0.5B shape, random weights"
    from services.common.model_store import resolve_model
    from services.engine.model import load_model
    path = resolve_model(shape)
    return load_model(path, device, dtype), str(path)


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(10, vocab, (count, length), generator=g).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def baseline(model, batch: list[list[int]], new_tokens: int, device: torch.device) -> float:
    ids = torch.tensor(batch, device=device)
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    sync(device)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


class Server:
    """The engine app under uvicorn in a background thread of this process."""

    def __init__(self, model, max_running: int, context: int, overlap: bool | None = None,
                 deterministic: bool = False) -> None:
        import uvicorn

        from services.engine.engine import Engine
        from services.engine.model import ModelRunner
        from services.engine.server import EngineHolder, create_app
        runner = ModelRunner(model, max_slots=max_running, context_len=context)
        runner.batch_invariant = deterministic
        self.engine = Engine(runner, tokenizer=None, model_path="bench")
        if overlap is not None:  # before the first request: nothing is in flight yet
            self.engine.scheduler.overlap = overlap
        self.engine.start()
        self.port = free_port()
        config = uvicorn.Config(create_app(EngineHolder(engine=self.engine)), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()


_COUNTERS = ("decode_steps", "prefill_passes", "prefill_tokens")


async def engine_levels(url: str, work: list[list[int]], levels: list[int], new_tokens: int,
                        repeats: int, shared_client: bool = False) -> dict[int, dict]:
    """Best run per concurrency level (wall seconds and the engine's counters over it), each level warmed up.

    `shared_client`: one pooled SGLangClient sends all `c` requests, as rollout does; otherwise
    every concurrent stream has its own client, as `c` independent users would.
    """
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    best: dict[int, dict] = {}
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(SGLangClient(url, timeout=600))
        await first.wait_ready(120)
        count = max(levels)
        clients = [first] * count if shared_client else \
            [first] + [await stack.enter_async_context(SGLangClient(url, timeout=600)) for _ in range(count - 1)]
        for c in levels:
            batch = work[:c]
            await asyncio.gather(*(cl.generate(p, {**params, "max_new_tokens": 4})
                                   for cl, p in zip(clients, batch)))  # warm-up
            for _ in range(repeats):
                before = (await first.server_info())["internal_states"][0]
                t = time.perf_counter()
                replies = await asyncio.gather(*(cl.generate(p, params) for cl, p in zip(clients, batch)))
                elapsed = time.perf_counter() - t
                after = (await first.server_info())["internal_states"][0]
                tokens = sum(r["meta_info"]["completion_tokens"] for r in replies)
                assert tokens == c * new_tokens, tokens
                if elapsed < best.get(c, {}).get("seconds", float("inf")):
                    best[c] = {"seconds": elapsed, **{k: after[k] - before[k] for k in _COUNTERS}}
    return best


def _drive(url: str, work: list[list[int]], level: int, new_tokens: int, repeats: int,
           shared_client: bool) -> dict[int, dict]:
    """Load-generator process body (spawned): the client's CPU time stays off the server's GIL."""
    return asyncio.run(engine_levels(url, work, [level], new_tokens, repeats, shared_client))


def run_level(url: str, work: list[list[int]], level: int, new_tokens: int, repeats: int, client: str,
              pool: concurrent.futures.Executor | None) -> dict:
    """Best run at one level: wall seconds and the engine's counters over it (decode steps, prefill passes)."""
    shared = client == "thread-shared"
    if client == "process":
        return pool.submit(_drive, url, work, level, new_tokens, repeats, False).result()[level]
    return asyncio.run(engine_levels(url, work, [level], new_tokens, repeats, shared))[level]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="qwen2.5-0.5b (random weights) or a model name/folder "
                                                   "(default: SmolLM2-135M-Instruct on cpu, qwen2.5-0.5b on cuda)")
    ap.add_argument("--dtype", default=None, help="default float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 32 on cpu, 128 on cuda")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 16 on cpu, 128 on cuda")
    ap.add_argument("--repeats", type=int, default=None, help="default 1 on cpu, 3 on cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (cpu runs only)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each decode step before launching the next (the GPU default overlaps them)")
    ap.add_argument("--client", choices=["thread-shared", "thread", "process"], default="thread-shared",
                    help="the load generator: one shared pooled client in a thread of this process (default, the "
                         "first session's setting, so figures stay comparable), one client per stream in a thread, "
                         "or one client per stream in a separate process (the client's CPU off the server's GIL)")
    ap.add_argument("--deterministic-inference", action="store_true",
                    help="the engine as started with --enable-deterministic-inference (batch-invariant kernels)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(args.threads)  # both sides alike; 1 keeps a shared CPU box from oversubscribing
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype or ("bfloat16" if gpu else "float32")]
    shape = args.shape or ("qwen2.5-0.5b" if gpu else None)
    prompt_len = args.prompt_len or (128 if gpu else 32)
    new_tokens = args.max_new_tokens or (128 if gpu else 16)
    repeats = args.repeats or (3 if gpu else 1)
    levels = [int(c) for c in args.concurrency.split(",")]
    model, model_desc = build_model(shape, device, dtype)
    work = prompts(max(levels), prompt_len, model.config.vocab_size)

    rows = []
    baseline(model, work[:2], 4, device)  # warm-up
    server = Server(model, max_running=max(levels), context=prompt_len + new_tokens + 8,
                    overlap=False if args.no_overlap else None, deterministic=args.deterministic_inference)
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) \
        if args.client == "process" else None
    base, eng, stats = {}, {}, {}
    try:
        for c in levels:  # side by side per level, so both see the same machine load
            base[c] = min(baseline(model, work[:c], new_tokens, device) for _ in range(repeats))
            stats[c] = run_level(f"http://127.0.0.1:{server.port}", work, c, new_tokens, repeats, args.client, pool)
            eng[c] = stats[c]["seconds"]
            print(f"c={c}: baseline {c * new_tokens / base[c]:.1f} tok/s, engine {c * new_tokens / eng[c]:.1f} tok/s",
                  flush=True)
        info = server.engine.server_info()
    finally:
        if pool is not None:
            pool.shutdown()
        server.stop()
    for c in levels:
        tokens = c * new_tokens
        rows.append({"concurrency": c, "output_tokens": tokens,
                     "baseline_tok_s": round(tokens / base[c], 1), "engine_tok_s": round(tokens / eng[c], 1),
                     "ratio": round(base[c] / eng[c], 3), "baseline_s": round(base[c], 4), "engine_s": round(eng[c], 4),
                     "engine_decode_steps": stats[c]["decode_steps"],
                     "engine_steps_per_s": round(stats[c]["decode_steps"] / eng[c], 1),
                     "engine_prefill_passes": stats[c]["prefill_passes"]})

    kind = "gpu" if gpu else "cpu"
    result = {
        "benchmark": "engine output tokens/s vs transformers generate (batched), same prompts, greedy, fixed lengths",
        "device": torch.cuda.get_device_name(device) if gpu else platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "model": model_desc, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
        "max_new_tokens": new_tokens, "repeats": repeats, "client": args.client,
        "cpu_threads": None if gpu else torch.get_num_threads(), "engine_decode": info.get("decode_mode", "eager"),
        "engine_overlap": getattr(server.engine.scheduler, "overlap", False),
        "engine_deterministic_inference": args.deterministic_inference,
        "rows": rows,
    }
    out = pathlib.Path(args.out or ROOT / "bench" / "results" / f"engine_{kind}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'conc':>5} {'baseline tok/s':>15} {'engine tok/s':>13} {'ratio':>6} {'steps/s':>8} {'prefills':>9}")
    for r in rows:
        print(f"{r['concurrency']:>5} {r['baseline_tok_s']:>15} {r['engine_tok_s']:>13} {r['ratio']:>6} "
              f"{r['engine_steps_per_s']:>8} {r['engine_prefill_passes']:>9}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
