"""Per-step metrics from played episodes, TensorBoard event files and Prometheus series."""
from __future__ import annotations

import collections
import math
import os
import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.rollout.episode import Episode


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    if not xs:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def episode_metrics(played: list[Episode], failed: list[Episode], prefix: str = "") -> dict[str, float]:
    """Reward, success (overall and per task), lengths, turns, tokens and failures of a set of episodes."""
    m: dict[str, float] = {}
    rewards = [e.reward for e in played]
    m["reward_mean"] = _mean(rewards)
    m["reward_std"] = _std(rewards)
    m["success_rate"] = _mean([float(e.success) for e in played])
    by_task: dict[str, list[float]] = collections.defaultdict(list)
    for e in played:
        by_task[e.task_id].append(float(e.success))
    for task, xs in sorted(by_task.items()):
        m[f"success/{task}"] = _mean(xs)
    m["episode_len_mean"] = _mean([float(len(e.response_ids)) for e in played])
    m["turns_mean"] = _mean([float(len(e.turns)) for e in played])
    m["commands_ok_rate"] = _mean([float(t.exit_code == 0) for e in played for t in e.commands])
    m["answered_rate"] = _mean([float(e.answer is not None) for e in played])
    m["tokens_generated"] = float(sum(e.generated_tokens for e in played))
    m["episodes"] = float(len(played) + len(failed))
    m["episodes_failed"] = float(len(failed))
    for reason, n in collections.Counter(e.failed for e in failed).items():
        m[f"failed/{reason}"] = float(n)
    for reason, n in collections.Counter(e.end_reason for e in played).items():
        m[f"end/{reason}"] = float(n)
    return {f"{prefix}{k}": v for k, v in m.items()}


class TensorBoardWriter:
    """Scalars to TensorBoard event files, with the tensorboard package only (no torch)."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(str(logdir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary_pb2.Summary(value=[
            self._summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class PromMetrics:
    """The orchestrator's Prometheus series (served at GET /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.steps = Counter("rlyard_rollout_steps", "training steps completed", ["run"], registry=self.registry)
        self.episodes = Counter("rlyard_rollout_episodes", "episodes played", ["run", "outcome"],
                                registry=self.registry)
        self.tokens = Counter("rlyard_rollout_tokens_generated", "model tokens generated", ["run"],
                              registry=self.registry)
        self.reward = Gauge("rlyard_rollout_reward_mean", "mean reward of the last step", ["run"],
                            registry=self.registry)
        self.success = Gauge("rlyard_rollout_success_rate", "success rate of the last step", ["run"],
                             registry=self.registry)
        self.eval_success = Gauge("rlyard_rollout_eval_success_rate", "held-out greedy success", ["run"],
                                  registry=self.registry)
        self.step_seconds = Gauge("rlyard_rollout_step_seconds", "wall time of the last step by phase",
                                  ["run", "phase"], registry=self.registry)
        self.active_runs = Gauge("rlyard_rollout_active_runs", "runs pending or running", registry=self.registry)

    def record_step(self, run_id: str, m: dict[str, float]) -> None:
        self.steps.labels(run_id).inc()
        self.episodes.labels(run_id, "ok").inc(m.get("episodes", 0) - m.get("episodes_failed", 0))
        self.episodes.labels(run_id, "failed").inc(m.get("episodes_failed", 0))
        self.tokens.labels(run_id).inc(m.get("tokens_generated", 0))
        self.reward.labels(run_id).set(m.get("reward_mean", 0))
        self.success.labels(run_id).set(m.get("success_rate", 0))
        for phase in ("generation", "training", "weight_sync", "step"):
            if f"time/{phase}_s" in m:
                self.step_seconds.labels(run_id, phase).set(m[f"time/{phase}_s"])


def scalar_items(m: dict[str, float]) -> Iterable[tuple[str, float]]:
    for k, v in m.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            yield k, float(v)
