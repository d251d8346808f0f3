"""Logging set-up shared by the services: one line per record, service name first."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    """Configure the root logger for `service` and return the service's logger.

    The level comes from `level`, else `RLYARD_LOG_LEVEL`, else INFO.
    """
    level = (level or os.environ.get("RLYARD_LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "aiohttp", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return logging.getLogger(f"rlyard.{service}")
