"""Entry point: `python -m services.engine --port 30000 --model <name|path> --device cpu|cuda:N --dtype ...`."""
from __future__ import annotations

import argparse
import sys

from services.common.logs import setup_logging
from services.engine.engine import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.engine",
                                description="SGLang-compatible inference engine (native HTTP API) on CPU or one GPU.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (default 30000)")
    p.add_argument("--model", default=None,
                   help="model folder, cache alias or local HF id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="KV-cache slots = requests decoded together (default 64)")
    p.add_argument("--context-length", type=int, default=None,
                   help="cap on prompt + output tokens (default: the model's max positions)")
    p.add_argument("--require-weight-update-session", action="store_true",
                   help="refuse tensor/distributed updates outside begin/end_weight_update, like SGLang 0.5.23")
    p.add_argument("--weight-update-session-timeout", type=float, default=600.0,
                   help="seconds after which an unended begin_weight_update session is closed (default 600)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="decode eagerly on GPU (no CUDA graphs)")
    p.add_argument("--cuda-graph-max-len", type=int, default=2048,
                   help="KV positions per slot allocated up front for CUDA graphs (grows beyond on demand)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json only, as SGLang's (for benchmarks; default auto)")
    p.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="compute logits in fp32 (as SGLang's flag): log-probs closer to an fp32-head trainer")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant kernels (as SGLang's flag): a request's log-probs do not depend on what "
                        "it is batched with, and equal bit for bit those of a trainer run with --batch-invariant")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO or $RLYARD_LOG_LEVEL)")
    args = p.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda:N, got {args.device}")
    if args.max_running_requests < 1:
        p.error("--max-running-requests must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = setup_logging("engine", args.log_level)
    import uvicorn

    from services.engine.server import EngineHolder, create_app

    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                       max_running_requests=args.max_running_requests, context_length=args.context_length,
                       require_weight_update_session=args.require_weight_update_session,
                       weight_update_session_timeout_s=args.weight_update_session_timeout,
                       cuda_graph=not args.disable_cuda_graph, cuda_graph_max_len=args.cuda_graph_max_len,
                       fp32_lm_head=args.enable_fp32_lm_head,
                       deterministic_inference=args.enable_deterministic_inference, load_format=args.load_format)
    app = create_app(EngineHolder(cfg))
    log.info("serving SGLang-compatible API on http://%s:%d (model loads in the background)", args.host, args.port)
    # uvicorn handles SIGTERM/SIGINT: stops accepting, drains, then runs the lifespan shutdown (scheduler stop).
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
