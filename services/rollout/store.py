"""Runs on disk: one folder per run, so a restarted orchestrator still lists them.

    <runs_dir>/<run_id>/config.json    the validated RunConfig
                        state.json     RunInfo (state, step, last metrics, times, message)
                        metrics.jsonl  one line per training step
                        eval.jsonl     one line per held-out evaluation
                        samples.jsonl  a few full episodes per step (text, ids, reward)
                        failures.jsonl every failed episode with its reason
                        tb/            TensorBoard event files
                        report/        PNG plots and index.html, written at the end
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import time
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from services.rollout.config import RunConfig

State = Literal["pending", "running", "succeeded", "failed", "stopped"]
FINAL_STATES = ("succeeded", "failed", "stopped")


class RunInfo(BaseModel):
    """What GET /runs/{id} returns."""
    run_id: str
    name: str = ""
    state: State = "pending"
    step: int = 0
    total_steps: int = 0
    message: str = ""
    started_at: float = 0.0
    ended_at: float = 0.0
    policy_version: int = 0
    last_metrics: dict[str, float] = Field(default_factory=dict)
    run_dir: str = ""
    created_at: float = Field(default_factory=time.time)


def _atomic_write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    """The on-disk folder of one run."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    @property
    def run_id(self) -> str:
        return self.path.name

    def read_config(self) -> RunConfig:
        return RunConfig.model_validate_json((self.path / "config.json").read_text())

    def read_info(self) -> RunInfo:
        return RunInfo.model_validate_json((self.path / "state.json").read_text())

    def write_info(self, info: RunInfo) -> None:
        _atomic_write(self.path / "state.json", info.model_dump_json(indent=1))

    def append(self, name: str, record: dict[str, Any]) -> None:
        with open(self.path / name, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def read_jsonl(self, name: str) -> list[dict[str, Any]]:
        path = self.path / name
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash; the rest is still good
        return out


class RunStore:
    """All runs under one folder."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def create(self, config: RunConfig, name: str = "") -> tuple[RunDir, RunInfo]:
        run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        path = self.root / run_id
        path.mkdir(parents=True)
        _atomic_write(path / "config.json", config.model_dump_json(indent=1, by_alias=True))
        info = RunInfo(run_id=run_id, name=name or config.name, total_steps=config.steps,
                       run_dir=str(path.resolve()))
        rd = RunDir(path)
        rd.write_info(info)
        return rd, info

    def get(self, run_id: str) -> Optional[RunDir]:
        if not run_id or "/" in run_id or run_id.startswith("."):
            return None
        path = self.root / run_id
        return RunDir(path) if (path / "state.json").exists() else None

    def all(self) -> list[RunDir]:
        dirs = [RunDir(p) for p in self.root.iterdir() if (p / "state.json").exists()]
        return sorted(dirs, key=lambda d: d.run_id, reverse=True)

    def mark_interrupted(self) -> list[str]:
        """Runs left pending/running by a previous process become failed; return their ids."""
        marked = []
        for rd in self.all():
            try:
                info = rd.read_info()
            except (OSError, ValueError):
                continue
            if info.state not in FINAL_STATES:
                info.state = "failed"
                info.message = ("orchestrator stopped while the run was active; start it again with "
                                "\"resume\": true to continue from the trainer's last checkpoint")
                info.ended_at = time.time()
                rd.write_info(info)
                marked.append(info.run_id)
        return marked
