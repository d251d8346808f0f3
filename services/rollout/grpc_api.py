"""The run API over gRPC: `rlyard.v1.Rollout` (StartRun, GetRun, ListRuns, StopRun, WatchRun)."""
from __future__ import annotations

import json
from typing import AsyncIterator

import grpc

from services.common.proto.rlyard.v1 import rollout_pb2, rollout_pb2_grpc
from services.rollout.config import ConfigError, parse_config
from services.rollout.manager import RunManager, RunNotFound
from services.rollout.store import RunInfo
from services.rollout.validation import check_runnable

_STATE_TO_PB = {
    "pending": rollout_pb2.RUN_STATE_PENDING, "running": rollout_pb2.RUN_STATE_RUNNING,
    "succeeded": rollout_pb2.RUN_STATE_SUCCEEDED, "failed": rollout_pb2.RUN_STATE_FAILED,
    "stopped": rollout_pb2.RUN_STATE_STOPPED,
}
_PB_TO_STATE = {v: k for k, v in _STATE_TO_PB.items()}


def info_message(info: RunInfo, config_json: str = "") -> rollout_pb2.RunInfo:
    return rollout_pb2.RunInfo(
        run_id=info.run_id, name=info.name, state=_STATE_TO_PB[info.state], step=info.step,
        total_steps=info.total_steps, config_json=config_json, message=info.message,
        started_at=info.started_at, ended_at=info.ended_at, run_dir=info.run_dir,
        last_metrics={k: float(v) for k, v in info.last_metrics.items()})


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, manager: RunManager) -> None:
        self.manager = manager

    def _config_json(self, run_id: str) -> str:
        return self.manager.config(run_id).model_dump_json(by_alias=True)

    async def _get(self, run_id: str, context: grpc.aio.ServicerContext) -> RunInfo:
        if not run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id is required")
        try:
            return self.manager.get(run_id)
        except RunNotFound:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {run_id!r}; ListRuns lists them")
        raise AssertionError("unreachable")

    async def StartRun(self, request: rollout_pb2.StartRunRequest, context: grpc.aio.ServicerContext
                       ) -> rollout_pb2.RunInfo:
        try:
            cfg = parse_config(request.config)
            check_runnable(cfg)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid run config: {exc}")
        info = self.manager.start(cfg, request.name)
        return info_message(info, cfg.model_dump_json(by_alias=True))

    async def GetRun(self, request: rollout_pb2.RunRef, context: grpc.aio.ServicerContext) -> rollout_pb2.RunInfo:
        info = await self._get(request.run_id, context)
        return info_message(info, self._config_json(request.run_id))

    async def ListRuns(self, request: rollout_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
                       ) -> rollout_pb2.ListRunsResponse:
        bad = [s for s in request.states if s not in _PB_TO_STATE]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown run states {bad}")
        states = {_PB_TO_STATE[s] for s in request.states} or None
        return rollout_pb2.ListRunsResponse(runs=[info_message(i) for i in self.manager.list(states)])

    async def StopRun(self, request: rollout_pb2.RunRef, context: grpc.aio.ServicerContext) -> rollout_pb2.RunInfo:
        await self._get(request.run_id, context)
        return info_message(self.manager.stop(request.run_id))

    async def WatchRun(self, request: rollout_pb2.RunRef, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[rollout_pb2.RunEvent]:
        await self._get(request.run_id, context)
        async for ev in self.manager.watch(request.run_id):
            kind = ev["type"]
            if kind in ("step", "eval"):
                sm = rollout_pb2.StepMetrics(step=int(ev["step"]),
                                             metrics={k: float(v) for k, v in ev["metrics"].items()})
                yield rollout_pb2.RunEvent(**{kind: sm})
            elif kind == "progress":
                yield rollout_pb2.RunEvent(progress=rollout_pb2.StepProgress(
                    step=int(ev["step"]), phase=str(ev["phase"]), done=int(ev["done"]), total=int(ev["total"]),
                    failed=int(ev["failed"])))
            elif kind == "state":
                yield rollout_pb2.RunEvent(state=info_message(RunInfo.model_validate(ev["run"])))
            else:
                yield rollout_pb2.RunEvent(log=str(ev.get("message", json.dumps(ev))))
