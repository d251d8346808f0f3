"""Start a run through the rollout's public HTTP API and follow it over gRPC WatchRun.

Draws one progress bar per step (episodes done in the step's generate phase),
prints one line of metrics when a step ends, and returns the final RunInfo.
"""
from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import httpx
from tqdm import tqdm

from services.common.grpc_server import channel
from services.common.proto.rlyard.v1 import rollout_pb2, rollout_pb2_grpc

# Shown first, in this order, when present; the rest of a step's metrics stay in the run's metrics.jsonl.
HEADLINE = ("reward_mean", "success_rate", "loss", "tokens_trained", "episodes_failed",
            "time/generation_s", "time/training_s", "time/weight_sync_s", "weight_syncs", "step_s")
FINAL = {rollout_pb2.RUN_STATE_SUCCEEDED, rollout_pb2.RUN_STATE_FAILED, rollout_pb2.RUN_STATE_STOPPED}


def start_run(rollout_http: str, run_config: dict[str, Any], name: str = "") -> dict[str, Any]:
    """POST /runs — the same request as `curl -X POST $ROLLOUT/runs -d @config.json`."""
    body = dict(run_config)
    if name and "name" not in body:
        body["name"] = name
    reply = httpx.post(f"{rollout_http}/runs", json=body, timeout=30.0)
    if reply.status_code >= 400:
        raise RuntimeError(f"POST /runs failed with {reply.status_code}: {reply.text}")
    return reply.json()


def format_metrics(step: int, metrics: dict[str, float], limit: int = 10) -> str:
    """One line: headline metrics first, then the others alphabetically, `limit` in all."""
    keys = [k for k in HEADLINE if k in metrics]
    keys += sorted(k for k in metrics if k not in keys)
    parts = [f"{k}={_num(metrics[k])}" for k in keys[:limit]]
    return f"step {step:>3} | " + "  ".join(parts)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e12 else f"{v:.4g}"


async def follow(rollout_grpc: str, run_id: str, out: TextIO = sys.stdout) -> rollout_pb2.RunInfo:
    """Stream WatchRun until the run reaches a final state; draw bars and metric lines."""
    bar: tqdm | None = None
    bar_key: tuple[int, str] | None = None
    last: rollout_pb2.RunInfo | None = None

    def close_bar() -> None:
        nonlocal bar, bar_key
        if bar is not None:
            bar.close()
        bar, bar_key = None, None

    async with channel(rollout_grpc) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        async for event in stub.WatchRun(rollout_pb2.RunRef(run_id=run_id)):
            kind = event.WhichOneof("event")
            if kind == "progress":
                p = event.progress
                key = (p.step, p.phase)
                if key != bar_key:
                    close_bar()
                    label = "eval" if p.phase == "eval" else f"step {p.step} {p.phase}"
                    bar = tqdm(total=max(p.total, 1), desc=label, unit="ep", file=out, leave=False,
                               dynamic_ncols=True)
                    bar_key = key
                assert bar is not None
                bar.total = max(p.total, 1)
                bar.n = p.done
                bar.set_postfix(failed=p.failed)
                bar.refresh()
            elif kind in ("step", "eval"):
                close_bar()
                m = getattr(event, kind)
                prefix = "" if kind == "step" else "eval "
                print(prefix + format_metrics(m.step, dict(m.metrics)), file=out, flush=True)
            elif kind == "log":
                close_bar()
                print(f"  {event.log}", file=out, flush=True)
            elif kind == "state":
                last = event.state
                if last.state in FINAL:
                    break
    close_bar()
    if last is None:
        raise RuntimeError(f"WatchRun for {run_id} ended without a state")
    return last


def summary(info: rollout_pb2.RunInfo) -> str:
    """A short end-of-run summary."""
    state = rollout_pb2.RunState.Name(info.state).removeprefix("RUN_STATE_")
    lines = [f"run {info.run_id} {state}: {info.step}/{info.total_steps} steps"
             + (f" in {info.ended_at - info.started_at:.0f}s" if info.ended_at and info.started_at else "")]
    if info.message:
        lines.append(f"  {info.message}")
    if info.last_metrics:
        lines.append("  last step: " + format_metrics(info.step, dict(info.last_metrics), limit=99))
    if info.run_dir:
        lines.append(f"  run folder: {info.run_dir}")
    return "\n".join(lines)


def dump(info: rollout_pb2.RunInfo) -> str:
    """RunInfo as JSON (for logs)."""
    from google.protobuf.json_format import MessageToDict
    return json.dumps(MessageToDict(info), indent=2)
