"""The agent's prompt and turn format, built with the model's own chat template.

The prompt is encoded once. A tool turn (closing the assistant turn when the
model did not, the observation as a user message wrapped in
<tool_response>, and the opening of the next assistant turn) is rendered by the
chat template itself and encoded once, so the ids appended to an episode are
exactly the ids the engine is given next.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from services.rollout.sandbox_client import CommandResult

SYSTEM_PROMPT = (
    "You are an agent that solves tasks in a Linux shell. "
    "To run a bash command, reply with exactly one command as <bash>command</bash> and stop. "
    "You will see its output as <tool_response>output</tool_response>. "
    "Run one command per turn. When you know the result, reply with <answer>final answer</answer>."
)

# Worked examples shown as earlier turns of the conversation: the seed found a
# small model needs at least one to follow the format. (task, command, output, answer)
EXAMPLES = [
    ("What is 17 + 25? Use bash to compute it. Answer with the number.",
     "echo $((17 + 25))", "42", "42"),
    ("Use python3 to compute 3 to the power of 5. Answer with the result.",
     "python3 -c 'print(3 ** 5)'", "243", "243"),
    ("Which user are you running as? Answer with the user name.",
     "whoami", "agent", "agent"),
]

STOP_STRINGS = ["</bash>", "</answer>"]
_ACTION = re.compile(r"<(bash|answer)>(.*?)</\1>", re.DOTALL)
_SENTINEL = "\u2063RLYARD\u2063"


@dataclass
class Action:
    """What the model asked for in one turn."""
    kind: str  # "bash", "answer" or "none"
    text: str = ""


def parse_action(text: str) -> Action:
    """The first complete <bash>…</bash> or <answer>…</answer> of a turn, else kind "none"."""
    m = _ACTION.search(text)
    if not m:
        return Action("none")
    body = m.group(2).strip()
    if m.group(1) == "bash" and not body:
        return Action("none")
    return Action(m.group(1), body)


def tool_response_text(output: str) -> str:
    return f"<tool_response>\n{output}\n</tool_response>"


def format_observation(result: CommandResult, timeout_s: float, cap_chars: int) -> str:
    """Observation text the model sees for one command."""
    out = result.stdout
    if result.stderr:
        out = f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}{result.stderr}"
    out = out.rstrip("\n")
    if len(out) > cap_chars:
        half = cap_chars // 2
        out = f"{out[:half]}\n...[output truncated]...\n{out[-half:]}"
    notes = []
    if result.timed_out:
        notes.append(f"[command timed out after {timeout_s:g}s]")
    elif result.exit_code != 0:
        notes.append(f"[exit code {result.exit_code}]")
    if not out and not notes:
        out = "(no output)"
    return "\n".join(p for p in [out, *notes] if p)


class PromptBuilder:
    """Encodes prompts and tool turns for one tokenizer."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, examples: int = 3) -> None:
        self.tok = tokenizer
        self.system_prompt = system_prompt or SYSTEM_PROMPT
        if not 0 <= examples <= len(EXAMPLES):
            raise ValueError(f"examples must be 0..{len(EXAMPLES)}, got {examples}")
        self.examples = EXAMPLES[:examples]
        eos = tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token = tokenizer.eos_token or ""
        self._before_obs, self._after_obs = self._probe_template()

    def messages(self, instruction: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}]
        for task, command, output, answer in self.examples:
            msgs += [
                {"role": "user", "content": f"Task: {task}"},
                {"role": "assistant", "content": f"<bash>{command}</bash>"},
                {"role": "user", "content": tool_response_text(output)},
                {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            ]
        msgs.append({"role": "user", "content": f"Task: {instruction}"})
        return msgs

    def _render(self, msgs: list[dict[str, str]], gen: bool) -> str:
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def _probe_template(self) -> tuple[str, str]:
        """The template's text around an observation that follows an assistant turn.

        Rendered from the model's own template with sentinels, so any ChatML-like
        template (SmolLM2, Qwen) yields its exact turn-boundary text.
        """
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": _SENTINEL + "A"},
                {"role": "user", "content": tool_response_text(_SENTINEL + "O")}]
        full = self._render(msgs, gen=True)
        a_end = full.index(_SENTINEL + "A") + len(_SENTINEL) + 1
        o_start = full.index(_SENTINEL + "O")
        before = full[a_end:o_start]
        after = full[o_start + len(_SENTINEL) + 1:]
        return before, after

    def prompt_ids(self, instruction: str) -> list[int]:
        """Ids of the whole prompt, ending with the opening of the assistant turn."""
        text = self._render(self.messages(instruction), gen=True)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def tool_turn_text(self, observation: str, model_closed_turn: bool) -> str:
        """Text between the model's last token and the next assistant turn's first token.

        It closes the assistant turn unless the model already did (ended with EOS).
        """
        before = self._before_obs
        if model_closed_turn and self.eos_token and before.startswith(self.eos_token):
            before = before[len(self.eos_token):]
        return f"{before}{observation}{self._after_obs}"

    def tool_turn_ids(self, observation: str, model_closed_turn: bool) -> list[int]:
        """The tool turn, encoded once."""
        return self.encode(self.tool_turn_text(observation, model_closed_turn))

    def ends_with_eos(self, ids: list[int]) -> bool:
        return bool(ids) and ids[-1] in self.eos_ids
