"""Benchmark: end-to-end weight sync trainer (cuda:0) -> engine process (cuda:1), beside a raw copy.

For each model shape (random bf16 weights from the shape's config), the real
`services.engine` runs in its own process on the engine GPU (started with
`--load-format dummy`: it reads config.json only) and this process plays the
trainer, its parameters packed in a ParamArena as the trainer service packs
them: `WeightSyncer.sync(method="ipc")` (arena slices as buckets, one copy per
bucket into staging buffers on the engine's GPU, CUDA-IPC handle, POST
/update_weights_from_tensor, engine load), median of N after warm-up. Beside
it: the same without the arena (flatten per sync), and in the same run and
process the raw time of one cuda:0 -> cuda:1 copy of the same number of
bytes, and of 1 GiB (with trainer and engine on one GPU: a device-to-device
copy on that GPU). Afterwards the weights are perturbed and synced three
times through one syncer, and each time the engine's log-probs of a fixed
sequence are checked against this process's own forward pass (`verify`).

    python bench/weight_sync.py --shapes smollm2-135m,qwen2.5-0.5b,qwen2.5-7b --iters 20

Writes bench/results/weight_sync.json (one record per shape) and prints a table.
CPU fallback (`--device cpu`): shared-memory transfer to a CPU engine, no raw-copy baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from services.common.net import free_port  # noqa: E402

# Architecture facts (REFERENCE.md for Qwen2.5-0.5B; public configs for the others).
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2),
}


def build_config(shape: str):
    from transformers import AutoConfig
    facts = dict(SHAPES[shape])
    return AutoConfig.for_model(facts.pop("model_type"), **facts)


def random_model(shape: str, device: str, dtype=torch.bfloat16, seed: int = 0):
    """The shape's architecture with seeded random weights, built directly on `device`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(shape), dtype=dtype)
    return model.eval()


def model_weights(model):
    """(name, tensor) of the model's parameters, as the trainer's `named_weights()` gives them."""
    return ((n, p.detach()) for n, p in model.named_parameters())


def write_folder(model, folder: pathlib.Path, tokenizer_from: pathlib.Path | None = None,
                 config_only: bool = False) -> pathlib.Path:
    """Save `model` as a HF folder (safetensors) the engine can load, or only its config.json for an
    engine started with --load-format dummy; copy a tokenizer in if given."""
    if folder.exists():
        shutil.rmtree(folder)
    if config_only:
        folder.mkdir(parents=True)
        model.config.save_pretrained(folder)
    else:
        model.save_pretrained(folder)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (tokenizer_from / f).exists():
                shutil.copy(tokenizer_from / f, folder / f)
    return folder


class EngineProcess:
    """`python -m services.engine` in a subprocess; stopped with SIGTERM on exit."""

    def __init__(self, model: pathlib.Path, device: str, log_path: pathlib.Path, extra: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if device.startswith("cuda:"):
            # The engine process sees only its own GPU (as in a real deployment), so the trainer's
            # cuda:1 is the engine's cuda:0: CUDA-IPC handles cross by GPU UUID (weight_wire).
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = int(device.split(":")[1])
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
            device = "cuda:0"
        cmd = [sys.executable, "-m", "services.engine", "--port", str(self.port), "--model", str(model),
               "--device", device, *(extra or [])]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    async def wait_ready(self, timeout: float = 600) -> None:
        from services.common.sglang_client import SGLangClient
        async with SGLangClient(self.url) as c:
            task = asyncio.ensure_future(c.wait_ready(timeout))
            while not task.done():
                if self.proc.poll() is not None:
                    task.cancel()
                    raise RuntimeError(f"engine exited with {self.proc.returncode}; see {self.log.name}")
                await asyncio.sleep(0.5)
            await task

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def raw_copy_ms(nbytes: int, src: str, dst: str, iters: int) -> float:
    """Median time of one copy of `nbytes` from `src` to `dst` (CUDA events)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    times = []
    for i in range(iters + 3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        e0.record()
        b.copy_(a, non_blocking=True)
        e1.record()
        e1.synchronize()
        if i >= 3:
            times.append(e0.elapsed_time(e1))
    del a, b
    torch.cuda.empty_cache()
    return statistics.median(times)


async def time_sync(model, url: str, engine_device: str | None, bucket_mb: int, iters: int,
                    warmup: int = 3, flush_cache: bool = True, method: str = "ipc",
                    arena=None) -> tuple[list[float], list[dict], int, int]:
    """Median-ready list of end-to-end sync times (ms) through the real WeightSyncer."""
    from services.trainer.weight_sync import WeightSyncer
    syncer = WeightSyncer(default_method=method, bucket_mb=bucket_mb, engine_device=engine_device,
                          nccl_master=("127.0.0.1", free_port()))
    totals, timings = [], []
    report = None
    try:
        for i in range(warmup + iters):
            report = await syncer.sync(lambda: model_weights(model), model.config, [url], method=method,
                                       weight_version=f"b{bucket_mb}-{i}", flush_cache=flush_cache, arena=arena)
            if i >= warmup:
                totals.append(report.timing["total"])
                timings.append(report.timing)
    finally:
        await syncer.aclose()
    return totals, timings, report.bytes, report.buckets


async def check_version(url: str, expect: str) -> str:
    from services.common.sglang_client import SGLangClient
    async with SGLangClient(url) as c:
        info = await c.model_info()
    got = str(info.get("weight_version"))
    if got != expect:
        raise RuntimeError(f"engine reports weight_version {got!r}, expected {expect!r}")
    return got


async def engine_rtt_ms(url: str, iters: int) -> float:
    """Median round trip of a trivial request: the HTTP floor under every engine call."""
    from services.common.sglang_client import SGLangClient
    times = []
    async with SGLangClient(url) as c:
        for i in range(iters + 3):
            t0 = time.perf_counter()
            await c.model_info()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


async def verify(model, arena, url: str, engine_device: str | None, bucket_mb: int, rounds: int = 3) -> dict:
    """Perturb the weights in place, sync, and compare the engine's log-probs of a fixed random
    sequence with this process's forward pass, `rounds` times through one syncer: the first round
    opens new staging buffers, the later ones reuse them (the engine's held mappings, and its load
    queued behind the copy's IPC event). Every round the engine must move to the new weights."""
    from services.common.sglang_client import SGLangClient
    from services.trainer.weight_sync import WeightSyncer
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (48,), generator=gen).tolist()

    async def engine_lp() -> torch.Tensor:
        async with SGLangClient(url) as c:
            r = await c.generate(ids, {"max_new_tokens": 1, "temperature": 1.0}, return_logprob=True,
                                 logprob_start_len=0)
        return torch.tensor([e[0] for e in r["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64)

    syncer = WeightSyncer(bucket_mb=bucket_mb, engine_device=engine_device)
    out = []
    try:
        for i in range(rounds):
            before = await engine_lp()
            with torch.no_grad():
                for _, p in model.named_parameters():
                    p.mul_(1.5 if i % 2 == 0 else 1 / 1.5)  # in place: the arena holds the new values
                x = torch.tensor([ids], device=next(model.parameters()).device)
                logits = model(x).logits[0, :-1].float()
                want = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0].double().cpu()
            await syncer.sync(lambda: model_weights(model), model.config,
                              [url], weight_version=f"verify-{i}", arena=arena)
            after = await engine_lp()
            gap, moved = float((after - want).abs().mean()), float((after - before).abs().mean())
            out.append({"engine_vs_trainer_mean_abs": round(gap, 5), "engine_moved_mean_abs": round(moved, 5),
                        "ok": bool(gap < 0.1 * moved)})
    finally:
        await syncer.aclose()
    return {"rounds": out, "ok": all(r["ok"] for r in out)}


def median_phases(timings: list[dict]) -> dict:
    keys = sorted({k for t in timings for k in t})
    return {k: round(statistics.median(t.get(k, 0.0) for t in timings), 3) for k in keys}


async def bench_shape(shape: str, args, workdir: pathlib.Path, tokenizer: pathlib.Path | None) -> dict:
    trainer_dev, engine_dev = args.trainer_device, args.engine_device
    cuda = trainer_dev.startswith("cuda")
    t0 = time.time()
    from services.trainer.param_arena import ParamArena
    model = random_model(shape, trainer_dev, torch.bfloat16 if cuda else torch.float32)
    arena = ParamArena.pack(model)
    folder = write_folder(model, workdir / shape, tokenizer, config_only=True)
    print(f"[{shape}] folder written in {time.time() - t0:.1f}s", flush=True)
    engine = EngineProcess(folder, engine_dev, workdir / f"engine-{shape}.log",
                           ["--load-format", "dummy", *args.engine_args.split()])
    try:
        await engine.wait_ready()
        print(f"[{shape}] engine ready after {time.time() - t0:.1f}s", flush=True)
        variants = {}
        for bucket_mb in args.bucket_mb:
            totals, timings, nbytes, buckets = await time_sync(model, engine.url, engine_dev if cuda else None,
                                                               bucket_mb, args.iters, arena=arena)
            await check_version(engine.url, f"b{bucket_mb}-{args.iters + 2}")
            variants[str(bucket_mb)] = {"sync_ms_median": round(statistics.median(totals), 3),
                                        "sync_ms_min": round(min(totals), 3), "buckets": buckets,
                                        "phases_ms_median": median_phases(timings)}
            print(f"[{shape}] bucket {bucket_mb} MiB: {variants[str(bucket_mb)]}", flush=True)
        totals, timings, _, _ = await time_sync(model, engine.url, engine_dev if cuda else None,
                                                args.bucket_mb[0], args.iters)
        flatten = {"sync_ms_median": round(statistics.median(totals), 3),
                   "phases_ms_median": median_phases(timings)}
        print(f"[{shape}] bucket {args.bucket_mb[0]} MiB without the arena (flatten each sync): {flatten}",
              flush=True)
        totals, timings, _, _ = await time_sync(model, engine.url, engine_dev if cuda else None,
                                                args.bucket_mb[0], args.iters, flush_cache=False, arena=arena)
        no_flush = {"sync_ms_median": round(statistics.median(totals), 3),
                    "phases_ms_median": median_phases(timings)}
        print(f"[{shape}] bucket {args.bucket_mb[0]} MiB without flush_cache: {no_flush}", flush=True)
        rtt = await engine_rtt_ms(engine.url, args.iters)
        others = {}
        for method in args.also:  # the same push by another method, beside ipc
            try:
                totals, timings, _, _ = await time_sync(model, engine.url, engine_dev if cuda else None,
                                                        args.bucket_mb[0], args.iters, method=method)
                others[method] = {"sync_ms_median": round(statistics.median(totals), 3),
                                  "phases_ms_median": median_phases(timings)}
            except Exception as exc:
                others[method] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{shape}] {method}: {others[method]}", flush=True)
        print(f"[{shape}] engine round trip (GET /model_info): {rtt:.3f} ms", flush=True)
        checked = await verify(model, arena, engine.url, engine_dev if cuda else None, args.bucket_mb[0])
        print(f"[{shape}] verify: {checked}", flush=True)
        raw = raw_copy_ms(nbytes, trainer_dev, engine_dev, args.iters) if cuda else None
    finally:
        engine.stop()
        del model
        if cuda:
            torch.cuda.empty_cache()
        shutil.rmtree(folder, ignore_errors=True)
    best = min(variants, key=lambda k: variants[k]["sync_ms_median"])
    default = str(args.bucket_mb[0])
    rec = {"model": shape, "bytes": nbytes, "method": "ipc", "bucket_mb": int(default),
           "sync_ms_median": variants[default]["sync_ms_median"],
           "raw_copy_ms_median": None if raw is None else round(raw, 3),
           "ratio_to_raw": None if raw is None else round(variants[default]["sync_ms_median"] / raw, 3),
           "best_bucket_mb": int(best), "best_sync_ms_median": variants[best]["sync_ms_median"],
           "raw_copy_kind": ("same-GPU device-to-device copy" if trainer_dev == engine_dev
                             else f"{trainer_dev} -> {engine_dev} copy") if cuda else None,
           "iters": args.iters, "variants": variants, "without_arena": flatten,
           "without_flush_cache": no_flush, "verify": checked,
           "other_methods": others,
           "engine_http_round_trip_ms_median": round(rtt, 3),
           "device": f"trainer {trainer_dev}, engine {engine_dev} ({_gpu_name(trainer_dev)})"}
    return rec


def _gpu_name(dev: str) -> str:
    return torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else "cpu"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b,qwen2.5-7b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--bucket-mb", default="2048,1024,4096",
                   help="bucket caps to run; the first is the reported default")
    p.add_argument("--trainer-device", default="cuda:0")
    p.add_argument("--engine-device", default="cuda:1")
    p.add_argument("--engine-args", default="", help="extra flags for services.engine")
    p.add_argument("--also", default="", help="other methods to time beside ipc, e.g. nccl,disk")
    p.add_argument("--tokenizer", default=None, help="folder whose tokenizer files go into each model folder")
    p.add_argument("--workdir", default="/tmp/rlyard-bench")
    p.add_argument("--out", default=str(ROOT / "bench/results/weight_sync.json"))
    args = p.parse_args()
    args.bucket_mb = [int(x) for x in args.bucket_mb.split(",")]
    args.also = [m for m in args.also.split(",") if m]
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = pathlib.Path(args.tokenizer) if args.tokenizer else None
    records = []
    raw_1g = None
    if args.trainer_device.startswith("cuda"):
        raw_1g = raw_copy_ms(1 << 30, args.trainer_device, args.engine_device, args.iters)
        print(f"raw 1 GiB copy {args.trainer_device} -> {args.engine_device}: {raw_1g:.3f} ms", flush=True)
    for shape in args.shapes.split(","):
        try:
            rec = asyncio.run(bench_shape(shape, args, workdir, tokenizer))
        except Exception as exc:  # one failing shape must not lose the others' figures
            print(f"[{shape}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            rec = {"model": shape, "error": f"{type(exc).__name__}: {exc}"}
        rec["raw_copy_1gib_ms_median"] = None if raw_1g is None else round(raw_1g, 3)
        records.append(rec)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1))
    print(f"\n{'model':<14} {'bytes':>14} {'buckets':>7} {'sync ms':>9} {'raw copy ms':>11} {'ratio':>6} "
          f"{'best (MiB)':>14}")
    for r in records:
        if "error" in r:
            print(f"{r['model']:<14} ERROR {r['error']}")
            continue
        v = r["variants"][str(r["bucket_mb"])]
        print(f"{r['model']:<14} {r['bytes']:>14,} {v['buckets']:>7} {r['sync_ms_median']:>9.3f} "
              f"{r['raw_copy_ms_median'] or float('nan'):>11.3f} {r['ratio_to_raw'] or float('nan'):>6.2f} "
              f"{r['best_sync_ms_median']:>8.3f} ({r['best_bucket_mb']})")
    if raw_1g is not None:
        print(f"raw 1 GiB copy: {raw_1g:.3f} ms")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
