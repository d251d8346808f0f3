"""The HTTP port: E2B-compatible control plane (`/sandboxes`, `/v2/sandboxes`, ...), the envd routes
(mounted from envd_api) and `GET /health`.

The unmodified `e2b` SDK talks to it with `E2B_API_URL` and `E2B_SANDBOX_URL`
both pointing here; envd requests carry `E2b-Sandbox-Id`, which is how one
port serves both planes. Control-plane errors use E2B's envelope
`{"code": <http status>, "message": ...}`.
"""
from __future__ import annotations

import datetime as dt
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.sandbox import envd_api
from services.sandbox import box as m
from services.sandbox.errors import SandboxError
from services.sandbox.manager import Box, Manager

log = logging.getLogger(__name__)

ENVD_VERSION = "0.5.7"
E2B_DEFAULT_TEMPLATES = ("base", "code-interpreter-v1")


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def sandbox_body(box: Box, client_id: str = "rlyard") -> dict[str, Any]:
    """E2B's `Sandbox` object (create/connect reply)."""
    return {"templateID": box.template, "sandboxID": box.id, "clientID": client_id, "envdVersion": ENVD_VERSION,
            "envdAccessToken": box.envd_token, "alias": box.template, "domain": None}


def detail_body(box: Box) -> dict[str, Any]:
    """E2B's `ListedSandbox` / `SandboxDetail`."""
    r = box.resources
    return {"templateID": box.template, "sandboxID": box.id, "clientID": "rlyard", "alias": box.template,
            "startedAt": _iso(box.created_at), "endAt": _iso(box.expires_at),
            "cpuCount": max(1, r.cpu_millis // 1000), "memoryMB": r.memory_mb, "diskSizeMB": r.disk_mb,
            "state": "paused" if box.state == m.PAUSED else "running", "envdVersion": ENVD_VERSION,
            "envdAccessToken": box.envd_token, "metadata": box.metadata, "domain": None}


async def _json(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise SandboxError("invalid_argument", f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise SandboxError("invalid_argument", "request body must be a JSON object")
    return body


def create_app(manager: Manager) -> FastAPI:
    app = FastAPI(title="rlyard sandbox-executor (E2B-compatible)", docs_url="/docs")
    keys = set(manager.config.api_keys)
    if not keys:
        log.warning("HTTP API: no API keys configured (--api-key / RLYARD_SANDBOX_API_KEYS): any X-API-Key "
                    "is accepted")

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> Response:
        if request.headers.get("e2b-sandbox-id"):
            return envd_api.envd_error(exc)
        return error(exc.http_status, exc.message)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.headers.get("e2b-sandbox-id"):
            return await envd_api.authorize(manager, request, call_next)
        path = request.url.path
        if path in ("/health", "/docs", "/openapi.json"):
            return await call_next(request)
        key = request.headers.get("x-api-key")
        if not key and request.headers.get("authorization", "").lower().startswith("bearer "):
            key = request.headers["authorization"][7:]
        if keys and not any(secrets.compare_digest(key or "", k) for k in keys):
            return error(401, "missing or invalid X-API-Key; pass one of the keys the service was started with")
        return await call_next(request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **manager.stats()})

    def _template(body: dict) -> tuple[str, str]:
        name = str(body.get("templateID") or "")
        if name.startswith("snap-"):
            return "", name
        if not name or (name in E2B_DEFAULT_TEMPLATES and not manager.templates.exists(name)):
            name = manager.config.default_template
        return name, ""

    async def create(request: Request) -> Response:
        body = await _json(request)
        template, snapshot = _template(body)
        # E2B's allow_internet_access=true maps to egress to any public address through the proxy.
        network = {"allow_public": True} if body.get("allow_internet_access") is True else None
        box = await manager.create(template=template, snapshot_id=snapshot, timeout_s=int(body.get("timeout") or 0),
                                   auto_pause=bool(body.get("autoPause")), env=body.get("envVars") or {},
                                   metadata={str(k): str(v) for k, v in (body.get("metadata") or {}).items()},
                                   network=network)
        return JSONResponse(sandbox_body(box), status_code=201)

    app.post("/sandboxes")(create)
    app.post("/v2/sandboxes")(create)

    async def list_sandboxes(request: Request) -> Response:
        q = request.query_params
        states = [s for s in (q.get("state") or "").split(",") if s] or ["running", "paused"]
        meta: dict[str, str] = {}
        if q.get("metadata"):
            from urllib.parse import parse_qsl
            meta = dict(parse_qsl(q["metadata"]))
        want = [s for s in states if s in ("running", "paused")]
        boxes = [b for b in manager.list(metadata=meta)
                 if ("paused" if b.state == m.PAUSED else "running") in want]
        limit = int(q.get("limit") or 0) or len(boxes) or 1
        start = int(q.get("nextToken") or 0) if (q.get("nextToken") or "").isdigit() else 0
        page = boxes[start:start + limit]
        headers = {}
        if start + limit < len(boxes):
            headers["x-next-token"] = str(start + limit)
        return JSONResponse([detail_body(b) for b in page], headers=headers)

    app.get("/sandboxes")(list_sandboxes)
    app.get("/v2/sandboxes")(list_sandboxes)

    @app.get("/sandboxes/{sid}")
    async def get_sandbox(sid: str) -> Response:
        box = manager.live(sid)
        return JSONResponse(detail_body(box))

    @app.delete("/sandboxes/{sid}")
    async def kill(sid: str) -> Response:
        await manager.kill(sid)
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/pause")
    async def pause(sid: str) -> Response:
        box = manager.live(sid)
        if box.state == m.PAUSED:
            return error(409, f"sandbox {sid} is already paused")
        await manager.pause(sid)
        return Response(status_code=204)

    async def connect(sid: str, request: Request) -> Response:
        body = await _json(request)
        timeout = int(body.get("timeout") or 0)
        box = manager.live(sid)
        if box.state == m.PAUSED:
            box = await manager.resume(sid, timeout)
            return JSONResponse(sandbox_body(box), status_code=201)
        if timeout:
            await manager.set_timeout(sid, timeout)
        return JSONResponse(sandbox_body(box), status_code=200)

    app.post("/sandboxes/{sid}/connect")(connect)
    app.post("/v2/sandboxes/{sid}/connect")(connect)

    @app.post("/sandboxes/{sid}/resume")
    async def resume(sid: str, request: Request) -> Response:
        body = await _json(request)
        box = manager.live(sid)
        if box.state != m.PAUSED:
            return error(409, f"sandbox {sid} is not paused")
        box = await manager.resume(sid, int(body.get("timeout") or 0))
        return JSONResponse(sandbox_body(box), status_code=201)

    @app.post("/sandboxes/{sid}/timeout")
    async def set_timeout(sid: str, request: Request) -> Response:
        body = await _json(request)
        await manager.set_timeout(sid, int(body.get("timeout") or 0))
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/refreshes")
    async def refresh(sid: str, request: Request) -> Response:
        body = await _json(request)
        await manager.set_timeout(sid, int(body.get("duration") or manager.config.timeout_s))
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/fork")
    async def fork(sid: str, request: Request) -> Response:
        body = await _json(request)
        children, _ = await manager.fork(sid, int(body.get("count") or 1), int(body.get("timeout") or 0))
        return JSONResponse([{"sandbox": sandbox_body(c)} for c in children], status_code=201)

    @app.post("/sandboxes/{sid}/snapshots")
    async def snapshot(sid: str, request: Request) -> Response:
        body = await _json(request)
        meta = {"name": str(body["name"])} if body.get("name") else {}
        snap = await manager.snapshot(sid, meta)
        names = [meta["name"]] if meta else []
        return JSONResponse({"snapshotID": snap["snapshot_id"], "names": names}, status_code=201)

    @app.get("/snapshots")
    async def list_snapshots(request: Request) -> Response:
        q = request.query_params
        snaps = sorted(manager.storage.list_snapshots(), key=lambda x: x["created_at"])
        if q.get("sandboxID"):
            snaps = [x for x in snaps if x["source_sandbox_id"] == q["sandboxID"]]
        if q.get("name"):
            snaps = [x for x in snaps if x.get("metadata", {}).get("name") == q["name"]]
        return JSONResponse([{"snapshotID": x["snapshot_id"],
                              "names": [x["metadata"]["name"]] if x.get("metadata", {}).get("name") else []}
                             for x in snaps])

    @app.delete("/templates/{tid}")
    async def delete_snapshot(tid: str) -> Response:
        manager.delete_snapshot(tid)
        return Response(status_code=204)

    @app.get("/sandboxes/{sid}/metrics")
    async def metrics(sid: str) -> Response:
        x = manager.metrics(sid)
        now = time.time()
        return JSONResponse([{"timestamp": _iso(now), "timestampUnix": int(now), "cpuCount": int(x["cpu_cores"]),
                              "cpuUsedPct": x["cpu_used_pct"], "memUsed": x["memory_used"],
                              "memTotal": x["memory_total"], "memCache": x["memory_cache"],
                              "diskUsed": x["disk_used"], "diskTotal": x["disk_total"]}])

    envd_api.add_routes(app, manager)
    return app
