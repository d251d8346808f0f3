"""FastAPI app exposing the engine through SGLang's native HTTP API (the subset rlyard uses).

The model loads in a background thread after the server starts, so /health
answers at once and /health_generate (and every model endpoint) answers 503
until the engine is ready, as SGLang does while starting. Invalid requests get
400 with a reason; weight endpoints answer `{"success", "message"}`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.engine.engine import BadRequest, Engine, EngineConfig

log = logging.getLogger(__name__)


class EngineHolder:
    """The engine once loaded, or the reason it is not there yet."""

    def __init__(self, cfg: EngineConfig | None = None, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.error: str | None = None
        self.ready = threading.Event()
        if engine is not None:
            self.ready.set()

    def load(self) -> None:
        try:
            engine = Engine.load(self.cfg)
            engine.start()
            self.engine = engine
            log.info("engine ready: %s on %s (%s)", engine.model_path, engine.runner.device,
                     engine.model_info()["dtype"])
        except Exception as exc:  # reported by every endpoint, the process stays inspectable
            log.exception("engine failed to load")
            self.error = f"engine failed to load: {exc}"
        finally:
            self.ready.set()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}, "message": message}, status_code=status)


def _result(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def create_app(holder: EngineHolder) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if holder.engine is None and holder.cfg is not None:
            threading.Thread(target=holder.load, name="engine-load", daemon=True).start()
        yield
        if holder.engine is not None:
            await asyncio.to_thread(holder.engine.stop)

    app = FastAPI(title="rlyard engine", lifespan=lifespan)

    def engine_or_503() -> Engine | JSONResponse:
        if holder.engine is None:
            return _error(503, holder.error or "engine is starting: model still loading")
        return holder.engine

    async def weight_op(request: Request, op: Callable[[Engine, Any], Awaitable[str]]) -> Response:
        engine = engine_or_503()
        if isinstance(engine, JSONResponse):
            return engine
        try:
            return _result(True, await op(engine, await _json(request)))
        except BadRequest as exc:
            return _result(False, str(exc))
        except Exception as exc:  # never let a failed update take the server down
            log.exception("weight operation failed")
            return _result(False, f"{type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        if holder.error:
            return _error(503, holder.error)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        engine = engine_or_503()
        if isinstance(engine, JSONResponse):
            return engine
        ok = await engine.health_generate()
        return Response(status_code=200) if ok else _error(503, "generation did not complete")

    @app.api_route("/model_info", methods=["GET", "POST"])
    @app.api_route("/get_model_info", methods=["GET", "POST"])
    async def model_info() -> Response:
        engine = engine_or_503()
        return engine if isinstance(engine, JSONResponse) else JSONResponse(engine.model_info())

    @app.api_route("/server_info", methods=["GET", "POST"])
    @app.api_route("/get_server_info", methods=["GET", "POST"])
    async def server_info() -> Response:
        engine = engine_or_503()
        return engine if isinstance(engine, JSONResponse) else JSONResponse(engine.server_info())

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        engine = engine_or_503()
        return engine if isinstance(engine, JSONResponse) else JSONResponse({"weight_version": engine.weight_version})

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        engine = engine_or_503()
        if isinstance(engine, JSONResponse):
            return engine
        try:
            return JSONResponse(await engine.generate(await _json(request)))
        except BadRequest as exc:
            return _error(400, str(exc))

    def weight_route(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await weight_op(request, lambda e, b: getattr(e, name)(b))
        return route

    # POST /<name> runs Engine.<name>(body): SGLang's weight-update endpoints, one reply shape.
    for name in ("update_weights_from_tensor", "update_weights_from_disk", "init_weights_update_group",
                 "update_weights_from_distributed", "destroy_weights_update_group"):
        app.add_api_route(f"/{name}", weight_route(name), methods=["POST"], name=name)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> Response:
        return await weight_op(request, lambda e, b: e.begin_weight_update(request.is_disconnected))

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> Response:
        return await weight_op(request, lambda e, b: e.end_weight_update())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        engine = engine_or_503()
        if isinstance(engine, JSONResponse):
            return engine
        if await engine.flush_cache():
            return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n", status_code=200)
        return _error(400, "Cache not flushed because there are pending requests.")

    async def control(request: Request, op: Callable[[Engine, Any], Awaitable[Any]]) -> Response:
        engine = engine_or_503()
        if isinstance(engine, JSONResponse):
            return engine
        try:
            body = await _json(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            await op(engine, body)
        except BadRequest as exc:
            return _error(400, str(exc))
        return JSONResponse({"success": True, "message": "Success"})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        return await control(request, lambda e, b: e.pause(b.get("mode", "abort")))

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        return await control(request, lambda e, b: e.resume())

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        return await control(request, lambda e, b: e.abort(b.get("rid"), bool(b.get("abort_all"))))

    return app
