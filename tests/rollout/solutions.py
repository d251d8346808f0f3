"""Replay a task's known-good solution (or a wrong answer) in a sandbox and run its verifier."""
from __future__ import annotations

from services.rollout.verify import prepare, verify


async def replay(task, sandbox, with_solution: bool):
    """Set the task up in `sandbox`, then either play its solution or answer "wrong"; return the verdict."""
    await prepare(task, sandbox)
    answer = "wrong"
    if with_solution:
        for cmd in task.solution.commands:
            await sandbox.run(cmd, 20)
        answer = task.solution.answer
        if task.solution.answer_command:
            answer = (await sandbox.run(task.solution.answer_command, 20)).stdout
    return await verify(task, answer, sandbox)
