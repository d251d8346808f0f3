"""Checks of a run config that need the disk (tasks, model), done before a run is created."""
from __future__ import annotations

from services.common.model_store import ModelNotFound, resolve_model
from services.rollout.config import ConfigError, RunConfig
from services.rollout.tasks import TaskError, select


def check_runnable(cfg: RunConfig) -> None:
    """Raise ConfigError naming the field when the run cannot start (unknown task, missing model)."""
    try:
        train = select(cfg.split, cfg.tasks)
    except TaskError as exc:
        raise ConfigError(f"{'tasks' if cfg.tasks else 'split'}: {exc}") from exc
    if not train:
        raise ConfigError(f"split: task split {cfg.split!r} is empty")
    if cfg.eval.every:
        try:
            select(cfg.eval.split, cfg.eval.tasks)
        except TaskError as exc:
            raise ConfigError(f"eval: {exc}") from exc
    try:
        resolve_model(cfg.model)
    except ModelNotFound as exc:
        raise ConfigError(f"model: {exc}") from exc
