"""Entry point: `python -m services.sandbox` serves gRPC and the E2B-compatible HTTP API;
`python -m services.sandbox template build|import|list|remove` manages templates."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from services.common.grpc_server import ServiceServer, stop_event_on_signals
from services.common.logs import setup_logging
from services.sandbox.config import SandboxConfig
from services.sandbox.templates import (DEFAULT_MIRROR, DEFAULT_PACKAGES, DEFAULT_SUITE, DEFAULT_TEMPLATE,
                                        TemplateError, TemplateStore, default_home)


def _kv(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = SandboxConfig()
    p = argparse.ArgumentParser(prog="python -m services.sandbox", description=__doc__)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, default=3000, help="E2B API + envd HTTP port (default 3000; 0 = off)")
    p.add_argument("--home", type=Path, default=None, help="state and template folder (default $RLYARD_HOME "
                                                           "or ~/.cache/rlyard)")
    p.add_argument("--backend", default="auto", choices=["auto", "namespace", "userns", "process"],
                   help="isolation backend (default auto: namespace as root, else userns, else process)")
    p.add_argument("--template", default=DEFAULT_TEMPLATE, help="default template name")
    p.add_argument("--max-sandboxes", type=int, default=d.max_sandboxes, help="live sandbox limit")
    p.add_argument("--timeout", type=int, default=d.timeout_s, help="default sandbox time to live, seconds")
    p.add_argument("--exec-timeout", type=float, default=d.exec_timeout_s, help="default command timeout, s")
    p.add_argument("--output-cap", type=int, default=d.output_cap, help="default output cap per stream, bytes")
    p.add_argument("--memory-mb", type=int, default=d.memory_mb, help="default memory limit per sandbox")
    p.add_argument("--pids", type=int, default=d.pids, help="default process limit per sandbox")
    p.add_argument("--cpu-millis", type=int, default=d.cpu_millis, help="default CPU quota (1000 = 1 core)")
    p.add_argument("--disk-mb", type=int, default=d.disk_mb, help="default writable-layer quota per sandbox")
    p.add_argument("--pool-size", type=int, default=d.pool_size,
                   help="warm sandboxes of the default template kept ready, so create is one hand-over (0 = off)")
    p.add_argument("--blank-pool", type=int, default=d.blank_pool,
                   help="blank sandboxes kept ready (namespaces, cgroups, /proc, /dev, /tmp; no root yet) for "
                        "creates the warm pool cannot serve and for fork children (default 16; 0 = off)")
    p.add_argument("--exec-helper", default=os.environ.get("RLYARD_EXEC_HELPER") or d.exec_helper,
                   metavar="auto|off|PATH",
                   help="how inits start commands: auto (default; $RLYARD_EXEC_HELPER overrides) builds the small "
                        "static exec helper with cc once and posix_spawns it (~2 ms faster per command than fork); "
                        "off forks the init; PATH uses a prebuilt helper (python -m services.sandbox.exec_helper DIR)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="variable every sandbox sees (repeatable); the service's own environment never leaks in")
    p.add_argument("--api-key", action="append", default=[], help="accepted X-API-Key (repeatable; default: "
                   "$RLYARD_SANDBOX_API_KEYS comma-separated; none = any key accepted)")
    p.add_argument("--on-exit", choices=["keep", "kill"], default="kill",
                   help="on SIGTERM/SIGINT, kill every sandbox (default) or keep them for re-adoption by the next "
                        "start (upgrades); after a crash the next start always re-adopts or cleans up")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default $RLYARD_LOG_LEVEL or INFO)")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("template", help="manage root-filesystem templates")
    tsub = t.add_subparsers(dest="action", required=True)
    b = tsub.add_parser("build", help="build a template with debootstrap (no-op when already built)")
    b.add_argument("name", nargs="?", default=DEFAULT_TEMPLATE)
    b.add_argument("--suite", default=DEFAULT_SUITE)
    b.add_argument("--mirror", default=DEFAULT_MIRROR)
    b.add_argument("--packages", default=",".join(DEFAULT_PACKAGES), help="comma-separated Debian packages")
    b.add_argument("--force", action="store_true", help="rebuild even if it exists")
    i = tsub.add_parser("import", help="import a rootfs tarball (docker export) or directory")
    i.add_argument("name")
    i.add_argument("source")
    i.add_argument("--force", action="store_true")
    tsub.add_parser("list", help="list templates")
    r = tsub.add_parser("remove", help="delete a template")
    r.add_argument("name")
    return p.parse_args(argv)


def template_command(args: argparse.Namespace) -> int:
    setup_logging("sandbox", args.log_level)
    store = TemplateStore(args.home or default_home())
    try:
        if args.action == "build":
            t = store.build(args.name, suite=args.suite, mirror=args.mirror,
                            packages=[x for x in args.packages.split(",") if x], force=args.force)
            print(f"{t.name}\t{t.rootfs}\t{t.source}\t{t.size_bytes / 1e6:.0f} MB")
        elif args.action == "import":
            t = store.import_path(args.name, args.source, force=args.force)
            print(f"{t.name}\t{t.rootfs}\t{t.source}\t{t.size_bytes / 1e6:.0f} MB")
        elif args.action == "list":
            for t in store.list():
                print(f"{t.name}\t{t.rootfs}\t{t.source}\t{t.size_bytes / 1e6:.0f} MB")
        elif args.action == "remove":
            store.remove(args.name)
    except TemplateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def make_config(args: argparse.Namespace) -> SandboxConfig:
    import os
    keys = list(args.api_key) or [k for k in os.environ.get("RLYARD_SANDBOX_API_KEYS", "").split(",") if k]
    return SandboxConfig(
        home=args.home or default_home(), backend=args.backend, default_template=args.template,
        max_sandboxes=args.max_sandboxes, timeout_s=args.timeout, exec_timeout_s=args.exec_timeout,
        output_cap=args.output_cap, memory_mb=args.memory_mb, pids=args.pids, cpu_millis=args.cpu_millis,
        disk_mb=args.disk_mb, env=_kv(args.env), api_keys=keys, pool_size=args.pool_size,
        blank_pool=args.blank_pool, exec_helper=args.exec_helper)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from services.sandbox import grpc_api
    from services.sandbox.http_api import create_app
    from services.sandbox.manager import Manager

    log = setup_logging("sandbox", args.log_level)
    stop = stop_event_on_signals()
    manager = Manager(make_config(args))
    await manager.start()
    grpc_server = ServiceServer(args.host, args.grpc_port)
    grpc_api.add_to(grpc_server, manager)
    await grpc_server.start()
    http = http_task = None
    if args.http_port:
        http = uvicorn.Server(uvicorn.Config(create_app(manager), host=args.host, port=args.http_port,
                                             log_level="warning", lifespan="off"))
        http.install_signal_handlers = lambda: None
        http_task = asyncio.create_task(http.serve())
    log.info("sandbox-executor ready: gRPC on %s:%d, HTTP (E2B API + envd) on %s:%s, backend %s, state in %s",
             args.host, grpc_server.port, args.host, args.http_port or "off", manager.backend,
             manager.config.state_dir)
    waiters = {asyncio.create_task(stop.wait())}
    if http_task:
        waiters.add(http_task)
    done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if http_task in done and http_task.exception():
        log.error("HTTP server failed: %s", http_task.exception())
    log.info("shutting down")
    if http:
        http.should_exit = True
    await grpc_server.stop(grace=2.0)
    await manager.stop(kill_all=args.on_exit == "kill")
    if http_task:
        await asyncio.gather(http_task, return_exceptions=True)
    for w in waiters:
        w.cancel()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "template":
        return template_command(args)
    try:
        asyncio.run(serve(args))
    except (OSError, RuntimeError, ValueError) as exc:
        logging.getLogger("rlyard.sandbox").error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
