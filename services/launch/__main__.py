"""`python -m services.launch --config configs/cpu-smoke.yaml` (what `make run` calls).

Starts sandbox, engine, trainer and rollout as separate processes, waits for
their health checks, starts the run from the config's `run:` section through
POST /runs, follows it with a progress bar per step and a line of metrics per
step, prints a summary, stops every process, and exits 0 only if the run
succeeded. Ctrl-C stops the run and every process cleanly.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
import sys
import time

import grpc
import httpx
import yaml

from services.common.logs import setup_logging
from services.launch.stack import Stack, plan
from services.launch.watch import follow, start_run, summary

log = logging.getLogger("rlyard.launch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cpu-smoke.yaml", help="run config file (services: and run:)")
    p.add_argument("--log-dir", default="runs/logs", help="where each service's log goes")
    p.add_argument("--attach", action="store_true",
                   help="do not start services; use the ones already listening on the configured ports")
    p.add_argument("--name", default="", help="run name (default: the config file's stem)")
    return p.parse_args(argv)


def load_config(path: pathlib.Path) -> dict:
    """Read a run config file; it must have a `run:` mapping (and optionally `services:`)."""
    if not path.exists():
        raise SystemExit(f"error: config {path} not found")
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("run"), dict):
        raise SystemExit(f"error: {path} needs a `run:` mapping (and usually `services:`)")
    return doc


def run_section(doc: dict) -> dict:
    """The run to start: the config's `run:` section, whose model (the tokenizer the rollout uses)
    defaults to the model the services serve."""
    run = dict(doc["run"])
    model = (doc.get("services") or {}).get("model")
    if model and "model" not in run:
        run["model"] = model
    return run


async def main_async(args: argparse.Namespace) -> int:
    # Ctrl-C and SIGTERM cancel this task; the handlers below stop the run and every service. Explicit
    # handlers also cover shells that start background jobs with SIGINT ignored.
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    cfg_path = pathlib.Path(args.config)
    doc = load_config(cfg_path)
    specs, ep = plan(doc.get("services") or {})
    stack = Stack(specs, pathlib.Path(args.log_dir))
    t0 = time.monotonic()
    run_id = None
    try:
        if not args.attach:
            print(f"starting services (logs in {args.log_dir}/) ...", flush=True)
            await stack.start()
            print(f"all four services healthy after {time.monotonic() - t0:.0f}s", flush=True)
        run = start_run(ep.rollout_http, run_section(doc), name=args.name or cfg_path.stem)
        run_id = run.get("run_id") or run.get("id")
        print(f"run {run_id} started (curl {ep.rollout_http}/runs/{run_id})", flush=True)
        info = await follow(ep.rollout_grpc, run_id)
        print(summary(info), flush=True)
        print(f"total wall time {time.monotonic() - t0:.0f}s", flush=True)
        from services.common.proto.rlyard.v1 import rollout_pb2
        return 0 if info.state == rollout_pb2.RUN_STATE_SUCCEEDED else 1
    except asyncio.CancelledError:
        print("\ninterrupted: stopping the run and the services", flush=True)
        if run_id:
            try:
                httpx.delete(f"{ep.rollout_http}/runs/{run_id}", timeout=5.0)
            except httpx.HTTPError:
                pass
        return 130
    except (RuntimeError, TimeoutError, grpc.aio.AioRpcError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        for name in stack.failed():
            print(f"--- {name} exited; its log ends with:\n{stack.tail(name)}", file=sys.stderr)
        return 1
    finally:
        if not args.attach:
            stack.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging("launch")
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
