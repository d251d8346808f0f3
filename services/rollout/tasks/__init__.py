"""Shell tasks as data: load and validate the YAML/JSONL task files of a split.

A split named S is every task in `S.yaml`, `S.yml` and `S.jsonl` of a task
directory (this package's folder by default, or $RLYARD_TASKS_DIR). Users add
tasks by dropping such a file next to the shipped ones; see train.yaml for the
format.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TASKS_DIR = pathlib.Path(__file__).resolve().parent
NORMALIZERS = ("strip", "lower", "collapse_ws", "strip_quotes", "strip_period")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AnswerCheck(_Strict):
    """Compare the final <answer> with `expected` (or with the output of `expected_command`)."""
    type: Literal["answer"]
    match: Literal["exact", "regex", "contains"] = "exact"
    expected: Optional[str] = None
    expected_command: Optional[str] = None
    normalize: list[Literal[NORMALIZERS]] = Field(default_factory=lambda: ["strip"])  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _one_source(self) -> "AnswerCheck":
        if (self.expected is None) == (self.expected_command is None):
            raise ValueError("an answer check needs exactly one of `expected` and `expected_command`")
        return self


class CommandCheck(_Strict):
    """Run `command` in the episode's sandbox after the episode; exit 0 passes."""
    type: Literal["command"]
    command: str
    timeout_s: float = 10.0


Check = Annotated[Union[AnswerCheck, CommandCheck], Field(discriminator="type")]


class Setup(_Strict):
    """Prepared before the model acts: files written, then commands run (must exit 0)."""
    files: dict[str, str] = Field(default_factory=dict)
    commands: list[str] = Field(default_factory=list)


class Solution(_Strict):
    """A known-good solution, replayed by the tests to prove the checks."""
    commands: list[str] = Field(default_factory=list)
    answer: Optional[str] = None
    answer_command: Optional[str] = None


class Task(_Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    instruction: str = Field(min_length=1)
    category: str = "general"
    difficulty: int = Field(1, ge=1, le=5)
    setup: Setup = Field(default_factory=Setup)
    verify: list[Check] = Field(min_length=1)
    solution: Optional[Solution] = None
    split: str = ""

    @property
    def needs_answer(self) -> bool:
        return any(isinstance(c, AnswerCheck) for c in self.verify)


class TaskError(ValueError):
    """A task file or task selection that cannot be used; the message says which and why."""


def tasks_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("RLYARD_TASKS_DIR") or TASKS_DIR)


def _read_records(path: pathlib.Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise TaskError(f"{path}:{n}: invalid JSON: {exc}") from exc
        return out
    data = yaml.safe_load(text) or []
    if not isinstance(data, list):
        raise TaskError(f"{path}: a task file holds a list of tasks")
    return data


def load_split(split: str, directory: pathlib.Path | None = None) -> list[Task]:
    """All tasks of `split`, in file order; raise TaskError on a bad file or duplicate id."""
    directory = directory or tasks_dir()
    files = [directory / f"{split}{ext}" for ext in (".yaml", ".yml", ".jsonl")]
    files = [f for f in files if f.exists()]
    if not files:
        known = sorted({p.stem for p in directory.iterdir() if p.suffix in (".yaml", ".yml", ".jsonl")})
        raise TaskError(f"no task split {split!r} in {directory}; known splits: {known}")
    tasks: list[Task] = []
    seen: set[str] = set()
    for f in files:
        for i, rec in enumerate(_read_records(f)):
            try:
                task = Task.model_validate({**rec, "split": split})
            except ValidationError as exc:
                name = rec.get("id", f"#{i}") if isinstance(rec, dict) else f"#{i}"
                raise TaskError(f"{f}: task {name}: {exc}") from exc
            if task.id in seen:
                raise TaskError(f"{f}: duplicate task id {task.id!r}")
            seen.add(task.id)
            tasks.append(task)
    return tasks


def select(split: str, ids: list[str] | None = None) -> list[Task]:
    """Tasks of `split`, restricted to `ids` (in that order) when given."""
    tasks = load_split(split)
    if not ids:
        return tasks
    by_id = {t.id: t for t in tasks}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise TaskError(f"unknown task ids in split {split!r}: {missing}; known: {sorted(by_id)}")
    return [by_id[i] for i in ids]
