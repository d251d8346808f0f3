"""The run API over HTTP (FastAPI; OpenAPI at /docs).

POST /runs, GET /runs, GET /runs/{id}, GET /runs/{id}/metrics,
GET /runs/{id}/events (server-sent events), DELETE /runs/{id},
GET /runs/{id}/report/{file}, GET /health, GET /metrics (Prometheus).
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.rollout.config import ConfigError, RunConfig
from services.rollout.manager import RunManager, RunNotFound
from services.rollout.store import RunInfo
from services.rollout.validation import check_runnable

_STATES = {"pending", "running", "succeeded", "failed", "stopped"}


def create_app(manager: RunManager) -> FastAPI:
    app = FastAPI(title="rlyard rollout-orchestrator",
                  description="Start, watch and stop RL runs. A run config is the JSON body of POST /runs.",
                  version="0.1.0")

    def _info(run_id: str) -> RunInfo:
        try:
            return manager.get(run_id)
        except RunNotFound:
            raise HTTPException(404, f"no run {run_id!r}; GET /runs lists them") from None

    @app.post("/runs", status_code=201, response_model=RunInfo)
    async def start_run(config: RunConfig, name: Optional[str] = Query(None)) -> RunInfo:
        """Start a run; returns at once with its id (state pending/running)."""
        try:
            check_runnable(config)
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from exc
        return manager.start(config, name or "")

    @app.get("/runs", response_model=list[RunInfo])
    async def list_runs(state: Optional[str] = Query(None, description="comma-separated states")) -> list[RunInfo]:
        """All runs on disk, newest first."""
        states = {s.strip() for s in state.split(",")} if state else None
        if states and not states <= _STATES:
            raise HTTPException(422, f"state: unknown {sorted(states - _STATES)}; use {sorted(_STATES)}")
        return manager.list(states)

    @app.get("/runs/{run_id}")
    async def get_run(run_id: str) -> dict[str, Any]:
        """The run's state and its validated config."""
        info = _info(run_id)
        return {**info.model_dump(), "config": manager.config(run_id).model_dump(by_alias=True)}

    @app.get("/runs/{run_id}/metrics")
    async def get_metrics(run_id: str) -> dict[str, Any]:
        """Every step's and every evaluation's metrics."""
        _info(run_id)
        return manager.metrics(run_id)

    @app.get("/runs/{run_id}/events")
    async def events(run_id: str, request: Request) -> StreamingResponse:
        """Server-sent events: `state`, `step`, `eval` and `log`; past steps first, ends with the run."""
        _info(run_id)

        async def stream() -> AsyncIterator[bytes]:
            async for ev in manager.watch(run_id):
                if await request.is_disconnected():
                    return
                yield f"event: {ev['type']}\ndata: {json.dumps(ev, default=float)}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.delete("/runs/{run_id}", status_code=202, response_model=RunInfo)
    async def stop_run(run_id: str) -> RunInfo:
        """Stop the run after its current step (state becomes stopped)."""
        _info(run_id)
        return manager.stop(run_id)

    @app.get("/runs/{run_id}/report/{filename}")
    async def report_file(run_id: str, filename: str) -> FileResponse:
        """The end-of-run report: index.html, reward.png, eval.png, time.png."""
        _info(run_id)
        folder = manager.run_dir(run_id).path / "report"
        path = (folder / filename).resolve()
        if path.parent != folder.resolve() or not path.is_file():
            raise HTTPException(404, f"no report file {filename!r} (the report is written when the run ends)")
        return FileResponse(path)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "active_runs": sum(1 for r in manager.list({"pending", "running"}))}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(manager.prom.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RunNotFound)
    async def _not_found(_: Request, exc: RunNotFound) -> JSONResponse:
        return JSONResponse({"detail": f"no run {exc.args[0]!r}"}, status_code=404)

    return app

