"""The orchestrator's runs: start, list, describe, stop, and watch (past events, then live ones).

Shared by the HTTP and the gRPC API so both behave the same.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from services.rollout.config import RunConfig
from services.rollout.metrics import PromMetrics
from services.rollout.runner import Endpoints, RunLoop
from services.rollout.store import FINAL_STATES, RunDir, RunInfo, RunStore

log = logging.getLogger(__name__)


class RunNotFound(KeyError):
    """No run with that id."""


class _Live:
    def __init__(self, loop: RunLoop, task: asyncio.Task) -> None:
        self.loop = loop
        self.task = task
        self.subscribers: set[asyncio.Queue] = set()


class RunManager:
    def __init__(self, runs_dir: str, endpoints: Endpoints) -> None:
        self.store = RunStore(runs_dir)
        self.endpoints = endpoints
        self.prom = PromMetrics()
        self._live: dict[str, _Live] = {}
        interrupted = self.store.mark_interrupted()
        if interrupted:
            log.warning("runs left active by a previous orchestrator marked failed: %s", interrupted)

    # ---- commands ---------------------------------------------------------------------------
    def start(self, cfg: RunConfig, name: str = "") -> RunInfo:
        rd, info = self.store.create(cfg, name)
        loop = RunLoop(cfg, rd, info, self.endpoints, lambda ev: self._publish(info.run_id, ev), self.prom,
                       asyncio.Event())
        task = asyncio.create_task(self._execute(loop), name=f"run-{info.run_id}")
        self._live[info.run_id] = _Live(loop, task)
        self._update_active()
        return info

    async def _execute(self, loop: RunLoop) -> None:
        try:
            await loop.execute()
        finally:
            live = self._live.pop(loop.info.run_id, None)
            self._update_active()
            if live:
                for q in live.subscribers:
                    q.put_nowait(None)

    def stop(self, run_id: str) -> RunInfo:
        """Ask a run to stop after its current step; a finished run is returned as is."""
        live = self._live.get(run_id)
        if live is None:
            return self.get(run_id)
        live.loop.stop.set()
        live.loop._log("stop requested; the run ends after its current step")
        return live.loop.info

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop every run (cancelling after `grace` seconds) so that each ends in a final state."""
        for live in list(self._live.values()):
            live.loop.stop.set()
        tasks = [lv.task for lv in self._live.values()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # ---- queries ----------------------------------------------------------------------------
    def _dir(self, run_id: str) -> RunDir:
        rd = self.store.get(run_id)
        if rd is None:
            raise RunNotFound(run_id)
        return rd

    def get(self, run_id: str) -> RunInfo:
        live = self._live.get(run_id)
        if live is not None:
            return live.loop.info
        return self._dir(run_id).read_info()

    def config(self, run_id: str) -> RunConfig:
        return self._dir(run_id).read_config()

    def list(self, states: Optional[set[str]] = None) -> list[RunInfo]:
        out = []
        for rd in self.store.all():
            try:
                info = self.get(rd.run_id)
            except (OSError, ValueError, RunNotFound):
                continue
            if not states or info.state in states:
                out.append(info)
        return out

    def metrics(self, run_id: str) -> dict[str, Any]:
        rd = self._dir(run_id)
        return {"run_id": run_id, "steps": rd.read_jsonl("metrics.jsonl"), "eval": rd.read_jsonl("eval.jsonl")}

    def run_dir(self, run_id: str) -> RunDir:
        return self._dir(run_id)

    # ---- events -----------------------------------------------------------------------------
    def _publish(self, run_id: str, event: dict[str, Any]) -> None:
        live = self._live.get(run_id)
        if live is None:
            return
        for q in live.subscribers:
            q.put_nowait(event)

    async def watch(self, run_id: str) -> AsyncIterator[dict[str, Any]]:
        """Past step and eval events, then live ones, ending with the run's final state."""
        rd = self._dir(run_id)
        q: asyncio.Queue = asyncio.Queue()
        live = self._live.get(run_id)
        if live is not None:
            live.subscribers.add(q)  # subscribe before reading history: nothing is missed
        try:
            past = [{"type": "step", "step": r["step"], "metrics": _scalars(r)} for r in rd.read_jsonl("metrics.jsonl")]
            past += [{"type": "eval", "step": r["step"], "metrics": _scalars(r)} for r in rd.read_jsonl("eval.jsonl")]
            past.sort(key=lambda e: (e["step"], e["type"] == "step"))
            seen = {(e["type"], e["step"]) for e in past}
            yield {"type": "state", "run": self.get(run_id).model_dump()}
            for ev in past:
                yield ev
            if live is None:
                return
            while True:
                ev = await q.get()
                if ev is None:
                    break
                if ev["type"] in ("step", "eval") and (ev["type"], ev["step"]) in seen:
                    continue
                yield ev
                if ev["type"] == "state" and ev["run"]["state"] in FINAL_STATES:
                    return
            yield {"type": "state", "run": self.get(run_id).model_dump()}
        finally:
            if live is not None:
                live.subscribers.discard(q)

    def _update_active(self) -> None:
        self.prom.active_runs.set(len(self._live))


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
