"""Entry point: `python -m services.trainer --port 50052 --model NAME --device cpu|cuda:0`.

Serves the Trainer gRPC service (proto/rlyard/v1/trainer.proto) with health
checking and reflection. Under torchrun with several ranks the model is
sharded with FSDP2; rank 0 serves gRPC and the other ranks follow its
commands (see services/trainer/distributed.py and README.md).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.common.grpc_server import ServiceServer, stop_event_on_signals
from services.common.logs import setup_logging
from services.common.model_store import ModelNotFound

log = logging.getLogger("rlyard.trainer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="gRPC bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50052, help="gRPC port (default 50052; 0 = any free port)")
    p.add_argument("--model", default=None, help="model folder, cache alias or HF id (default SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda:N (default cuda:0 when CUDA is present, else cpu)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--random-init", action="store_true", help="random weights from config.json (benchmarks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-6, help="default learning rate (a step's LossConfig.lr wins)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--micro-batch-tokens", type=int, default=8192,
                   help="token budget of one micro-batch (padded count x longest)")
    p.add_argument("--logprob-chunk-mb", type=int, default=128,
                   help="size cap of one fp32 [tokens, vocab] log-softmax chunk")
    p.add_argument("--fp32-lm-head", action="store_true",
                   help="logits in fp32 (no bf16 rounding; pair with the engine's --enable-fp32-lm-head)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="forward through the batch-invariant kernels (single GPU): log-probs equal bit for bit "
                        "those of an engine started with --enable-deterministic-inference")
    p.add_argument("--max-seq-len", type=int, default=0, help="longest prompt+response (0: the model's)")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--optimizer-offload", action="store_true",
                   help="keep fp32 master weights and AdamW moments in pinned host memory")
    p.add_argument("--kl-reference", action="store_true",
                   help="keep a frozen copy of the initial policy for the k3 KL term")
    p.add_argument("--eps-low", type=float, default=0.2)
    p.add_argument("--eps-high", type=float, default=0.28)
    p.add_argument("--dual-clip-c", type=float, default=3.0, help="dual-clip constant (> 1; 0 disables)")
    p.add_argument("--aggregation", default="token_mean", choices=["token_mean", "seq_mean"])
    p.add_argument("--checkpoint-dir", default=None, help="where SaveCheckpoint writes step-N folders")
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint of --checkpoint-dir at start")
    p.add_argument("--sync-method", default="ipc", choices=["ipc", "nccl", "disk"], help="default SyncWeights method")
    p.add_argument("--bucket-mb", type=int, default=2048,
                   help="default bucket size cap for ipc/nccl (2 buckets in flight on each GPU)")
    p.add_argument("--engine-sessions", default="auto", choices=["auto", "always"],
                   help="begin/end_weight_update around each sync: only when the server demands it "
                        "(auto), or always (saves a refused call per update on SGLang >= 0.5.23)")
    p.add_argument("--bucket-layout", default="bytes", choices=["bytes", "elements"],
                   help="flattened bucket layout: bytes (SGLang 0.5.23) or elements (0.5.16)")
    p.add_argument("--engine-device", default=None,
                   help="the engines' GPU for ipc (default: the next GPU if there are two, else the same)")
    p.add_argument("--sync-dir", default=None, help="folder for disk syncs (default: a temp folder)")
    p.add_argument("--nccl-master", default="127.0.0.1:29600",
                   help="host:port the nccl weight-update group rendezvouses on")
    p.add_argument("--log-level", default=None)
    return p


def _settings(args):
    from services.trainer.losses import LossSettings
    from services.trainer.trainer import TrainerSettings
    loss = LossSettings(eps_low=args.eps_low, eps_high=args.eps_high, dual_clip_c=args.dual_clip_c,
                        aggregation=args.aggregation, lr=args.lr)
    loss.validate()
    return TrainerSettings(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                           micro_batch_tokens=args.micro_batch_tokens, logprob_chunk_mb=args.logprob_chunk_mb,
                           fp32_lm_head=args.fp32_lm_head, batch_invariant=args.batch_invariant,
                           optimizer_offload=args.optimizer_offload, kl_reference=args.kl_reference,
                           max_seq_len=args.max_seq_len, loss=loss)


async def serve(args, trainer=None) -> int:
    """Serve gRPC; `trainer` is given under torchrun (rank 0's DistributedTrainer), else built here."""
    import torch

    from services.common.proto.rlyard.v1 import trainer_pb2, trainer_pb2_grpc
    from services.trainer import checkpoint
    from services.trainer.model import load_model, parse_dtype
    from services.trainer.servicer import TrainerServicer
    from services.trainer.trainer import PolicyTrainer
    from services.trainer.weight_sync import WeightSyncer

    if trainer is None:
        device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.error("--device %s but CUDA is not available; use --device cpu", device)
            return 2
        settings = _settings(args)
        torch.manual_seed(args.seed)
        model, folder = load_model(args.model, device, parse_dtype(args.dtype, device), args.random_init,
                                   args.seed, not args.no_gradient_checkpointing)
        trainer = PolicyTrainer(model, device, settings, model_name=str(folder))
    if args.resume:
        if not args.checkpoint_dir:
            log.error("--resume needs --checkpoint-dir")
            return 2
        latest = checkpoint.latest(args.checkpoint_dir)
        if latest is None:
            log.info("--resume: no checkpoint under %s yet, starting fresh", args.checkpoint_dir)
        else:
            (getattr(trainer, "load_checkpoint", None) or (lambda p: checkpoint.load(trainer, p)))(latest)
            log.info("resumed from %s at step %d", latest, trainer.step)
    host, _, port = args.nccl_master.rpartition(":")
    syncer = WeightSyncer(default_method=args.sync_method, bucket_mb=args.bucket_mb,
                          engine_device=args.engine_device, layout=args.bucket_layout,
                          disk_root=args.sync_dir, nccl_master=(host or "127.0.0.1", int(port)),
                          sessions=args.engine_sessions)
    servicer = TrainerServicer(trainer, syncer, args.checkpoint_dir)
    server = ServiceServer(args.host, args.port)
    server.add(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer,
               trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name)
    stop = stop_event_on_signals()
    port = await server.start()
    print(f"trainer listening on {args.host}:{port}", flush=True)
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    await syncer.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("trainer", args.log_level)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if args.batch_invariant:
            log.error("--batch-invariant is single-process (it reads parameters FSDP2 shards); drop it under torchrun")
            return 2
        from services.trainer.distributed import main_distributed
        return main_distributed(args)
    try:
        return asyncio.run(serve(args))
    except ModelNotFound as exc:
        log.error("%s", exc)
        return 2
    except ValueError as exc:
        log.error("bad setting: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
