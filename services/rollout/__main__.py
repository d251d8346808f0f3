"""Entry point: `python -m services.rollout` serves the run API over HTTP and gRPC."""
from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.grpc_server import ServiceServer, stop_event_on_signals
from services.common.logs import setup_logging
from services.common.proto.rlyard.v1 import rollout_pb2, rollout_pb2_grpc
from services.rollout.runner import Endpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.rollout",
                                description="rlyard rollout-orchestrator: start, watch and stop RL runs "
                                            "(HTTP API with OpenAPI at /docs, gRPC rlyard.v1.Rollout).")
    p.add_argument("--host", default="0.0.0.0", help="interface for both servers (default 0.0.0.0)")
    p.add_argument("--grpc-port", type=int, default=50053, help="gRPC port (default 50053)")
    p.add_argument("--http-port", type=int, default=8080, help="HTTP port (default 8080)")
    p.add_argument("--engine-url", default="http://127.0.0.1:30000", help="SGLang-compatible engine base URL")
    p.add_argument("--trainer-addr", default="127.0.0.1:50052", help="trainer gRPC address")
    p.add_argument("--sandbox-addr", default="127.0.0.1:50051", help="sandbox-executor gRPC address")
    p.add_argument("--runs-dir", default="runs", help="folder where runs persist (default ./runs)")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default $RLYARD_LOG_LEVEL or INFO)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from services.rollout.grpc_api import RolloutServicer
    from services.rollout.http_api import create_app
    from services.rollout.manager import RunManager

    log = setup_logging("rollout", args.log_level)
    stop = stop_event_on_signals()
    manager = RunManager(args.runs_dir, Endpoints(args.engine_url, args.trainer_addr, args.sandbox_addr))
    grpc_server = ServiceServer(args.host, args.grpc_port)
    grpc_server.add(rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(manager),
                    rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name)
    await grpc_server.start()
    http = uvicorn.Server(uvicorn.Config(create_app(manager), host=args.host, port=args.http_port,
                                         log_level="warning", lifespan="off"))
    http.install_signal_handlers = lambda: None  # signals are ours: stop runs first, then the servers
    http_task = asyncio.create_task(http.serve())
    log.info("rollout-orchestrator: HTTP on %s:%d (docs at /docs), gRPC on %s:%d, runs in %s",
             args.host, args.http_port, args.host, grpc_server.port, args.runs_dir)
    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({http_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        log.error("HTTP server failed: %s", http_task.exception())
    log.info("shutting down: stopping runs")
    await manager.shutdown(grace=10.0)
    http.should_exit = True
    await grpc_server.stop(grace=3.0)
    await asyncio.gather(http_task, return_exceptions=True)
    stop_wait.cancel()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
