"""Phase timing of one weight sync, in milliseconds, and the report a sync returns."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

PHASES = ("gather", "flatten", "copy", "serialise", "engine_load", "total")


class PhaseTimer:
    """Accumulates wall-clock milliseconds per phase."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {p: 0.0 for p in PHASES}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def add(self, name: str, ms: float) -> None:
        self.ms[name] = self.ms.get(name, 0.0) + ms


@dataclass
class SyncReport:
    """What one SyncWeights did."""

    method: str
    weight_version: str
    bytes: int = 0
    buckets: int = 0
    timing: dict[str, float] = field(default_factory=dict)
