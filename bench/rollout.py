"""Sync vs async rollout: episodes/s and step time, side by side, through the real services on CPU.

Starts the four services as separate processes (the launcher `make run` uses),
or uses ones already running (--rollout-http), then runs the same short run
config in `sync` and in `async` mode through the rollout's public HTTP API,
one after the other, on the same stack. Step 1 of each run is warm-up and
left out; the rate is measured between the end of step 1 and the end of the
last step (steps are timestamped by the orchestrator when they end).

    python bench/rollout.py                      # start a stack on free ports
    python bench/rollout.py --rollout-http http://127.0.0.1:8080   # reuse one
Writes bench/results/rollout.json and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import signal
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN = {
    "tasks": ["kernel_name_lower", "python_product", "exit_status_false", "grep_error_lines"],
    "prompts_per_step": 2, "group_size": 2, "concurrency": 8, "min_ok_fraction": 0.25,
    "sampling": {"temperature": 1.0, "max_new_tokens": 32}, "prompt": {"examples": 1},
    "episode": {"max_turns": 2, "max_response_tokens": 160, "context_limit": 768, "command_timeout_s": 10},
    "loss": {"lr": 1e-6}, "eval": {"every": 0}, "samples_per_step": 0,
}


def run_mode(http: str, mode: str, steps: int) -> dict:
    load_before = os.getloadavg()[0]
    body = {**RUN, "mode": mode, "steps": steps, "name": f"bench-{mode}"}
    if mode == "async":
        body["async"] = {"staleness_k": 1, "stale": "drop"}
    r = httpx.post(f"{http}/runs", json=body, timeout=30)
    r.raise_for_status()
    run_id = r.json()["run_id"]
    while True:
        info = httpx.get(f"{http}/runs/{run_id}", timeout=30).json()
        if info["state"] in ("succeeded", "failed", "stopped"):
            break
        time.sleep(2)
    if info["state"] != "succeeded":
        raise RuntimeError(f"{mode} run {run_id} {info['state']}: {info['message']}")
    steps_m = httpx.get(f"{http}/runs/{run_id}/metrics", timeout=30).json()["steps"]
    ends = [s["time"] for s in steps_m]
    measured = steps_m[1:]
    wall = ends[-1] - ends[0]
    episodes = sum(s["episodes"] for s in measured)
    return {
        "run_id": run_id, "mode": mode, "steps": len(steps_m), "measured_steps": len(measured),
        "episodes": episodes, "wall_s": wall, "episodes_per_s": episodes / wall,
        "step_s_mean": wall / len(measured),
        "generation_s_mean": sum(s["time/generation_s"] for s in measured) / len(measured),
        "training_s_mean": sum(s["time/training_s"] for s in measured) / len(measured),
        "weight_sync_s_mean": sum(s["time/weight_sync_s"] for s in measured) / len(measured),
        "staleness_mean": sum(s["staleness_mean"] for s in measured) / len(measured),
        "episodes_dropped_stale": sum(s.get("episodes_dropped_stale", 0) for s in measured),
        "tokens_generated": sum(s["tokens_generated"] for s in measured),
        "reward_mean": sum(s["reward_mean"] for s in measured) / len(measured),
        # The CPU may be shared: the 1-minute load average around the run says how much.
        "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
    }


async def _start_stack(tmp: pathlib.Path):
    from services.launch.stack import throwaway_stack
    stack = throwaway_stack(tmp)
    await stack.start(timeout=420)
    return stack, stack.endpoints.rollout_http


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollout-http", help="use an already running stack through this rollout URL")
    p.add_argument("--steps", type=int, default=5, help="steps per run (step 1 is warm-up)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout.json"))
    args = p.parse_args()
    # SIGTERM/SIGINT end the benchmark through `finally`, which stops every service it started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    stack = None
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rlyard-bench-rollout-"))
    try:
        http = args.rollout_http
        if not http:
            stack, http = asyncio.run(_start_stack(tmp))
        results = {mode: run_mode(http, mode, args.steps) for mode in ("sync", "async")}
    finally:
        if stack is not None:
            stack.stop()
    s, a = results["sync"], results["async"]
    out = {
        "bench": "rollout sync vs async",
        "machine": f"{platform.machine()} {platform.processor()} cpus={os.cpu_count()}",
        "config": RUN, "results": results,
        "ratios": {"episodes_per_s_async_over_sync": a["episodes_per_s"] / s["episodes_per_s"],
                   "step_s_async_over_sync": a["step_s_mean"] / s["step_s_mean"]},
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    rows = [("episodes/s", "episodes_per_s"), ("step time s", "step_s_mean"),
            ("generation s/step", "generation_s_mean"), ("training s/step", "training_s_mean"),
            ("weight sync s/step", "weight_sync_s_mean"), ("staleness mean", "staleness_mean"),
            ("stale episodes dropped", "episodes_dropped_stale")]
    print(f"{'metric':<24}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for label, key in rows:
        ratio = a[key] / s[key] if s[key] else float("nan")
        print(f"{label:<24}{s[key]:>10.3f}{a[key]:>10.3f}{ratio:>12.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
