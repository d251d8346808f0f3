"""Prepare a task's sandbox and judge an episode with the task's checks.

Works against any "executor" with `run(command, timeout_s, max_output_bytes)`
and `write_file(path, data)` coroutines (a `SandboxHandle` in production).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from services.rollout.sandbox_client import CommandResult
from services.rollout.tasks import AnswerCheck, CommandCheck, Task

_QUOTES = "\"'`"


class Executor(Protocol):
    async def run(self, command: str, timeout_s: float, max_output_bytes: int = 0) -> CommandResult: ...

    async def write_file(self, path: str, data: bytes, mode: int = 0) -> None: ...


class SetupFailed(RuntimeError):
    """A task's setup command failed in the sandbox; the task (not the model) is at fault."""


def normalize(text: str, ops: list[str]) -> str:
    """Apply the named normalisations in a fixed order."""
    if "strip" in ops or "collapse_ws" in ops:
        text = text.strip()
    if "collapse_ws" in ops:
        text = re.sub(r"\s+", " ", text)
    if "strip_quotes" in ops:
        while len(text) >= 2 and text[0] in _QUOTES and text[-1] == text[0]:
            text = text[1:-1].strip()
    if "strip_period" in ops and text.endswith("."):
        text = text[:-1].rstrip()
    if "lower" in ops:
        text = text.lower()
    return text


def answer_matches(answer: str | None, check: AnswerCheck, expected: str) -> bool:
    """True when `answer` satisfies `check` against `expected` (both normalised)."""
    if answer is None:
        return False
    got = normalize(answer, check.normalize)
    if check.match == "regex":
        try:
            return re.fullmatch(expected.strip(), got) is not None
        except re.error:
            return False
    want = normalize(expected, check.normalize)
    if check.match == "contains":
        return want in got
    return got == want


@dataclass
class Verdict:
    """Outcome of a task's checks: passed only if every check passed."""
    passed: bool
    checks: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


async def prepare(task: Task, sandbox: Executor, timeout_s: float = 30.0) -> None:
    """Write the task's setup files, then run its setup commands; raise SetupFailed on error."""
    for path, content in task.setup.files.items():
        await sandbox.write_file(path, content.encode())
    for cmd in task.setup.commands:
        r = await sandbox.run(cmd, timeout_s, 4096)
        if r.exit_code != 0:
            raise SetupFailed(f"task {task.id}: setup command {cmd!r} exited {r.exit_code}: "
                              f"{(r.stderr or r.stdout)[-300:]}")


async def verify(task: Task, answer: str | None, sandbox: Executor) -> Verdict:
    """Run every check of `task` for an episode that ended with `answer` (None if it gave none)."""
    verdict = Verdict(passed=True)
    for check in task.verify:
        if isinstance(check, CommandCheck):
            r = await sandbox.run(check.command, check.timeout_s, 4096)
            ok = r.exit_code == 0 and not r.timed_out
            if not ok:
                verdict.notes.append(f"check {check.command!r} exited {r.exit_code}")
        else:
            expected = check.expected
            if expected is None:
                r = await sandbox.run(check.expected_command or "", 10.0, 4096)
                expected = r.stdout
            ok = answer_matches(answer, check, expected)
            if not ok:
                verdict.notes.append(f"answer {answer!r} does not {check.match}-match {expected.strip()!r}")
        verdict.checks.append(ok)
        verdict.passed = verdict.passed and ok
    return verdict
