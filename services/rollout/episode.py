"""One multi-turn episode, token-in/token-out.

The prompt is encoded once. Each turn sends the running id sequence to the
engine's /generate; the generated ids are appended verbatim with their
log-probs and loss mask 1; the command parsed from them runs in the episode's
sandbox; the observation's tool turn is encoded once and appended with loss
mask 0 and log-prob 0. Nothing is ever re-tokenized, so the trainer sees
exactly the ids the engine produced and was given.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from services.rollout.config import EpisodeConfig, SamplingConfig
from services.rollout.prompt import STOP_STRINGS, PromptBuilder, format_observation, parse_action
from services.rollout.sandbox_client import SandboxError
from services.rollout.verify import Executor

_ABORT_RETRIES = 3


class Engine(Protocol):
    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       rid: Optional[str] = None) -> dict: ...


class EpisodeFailed(RuntimeError):
    """The episode could not be played for a reason that is not the model's fault."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class TurnRecord:
    action: str                      # "bash", "answer" or "none"
    text: str                        # decoded generated text of the turn
    generated: int                   # model tokens of the turn
    finish: str                      # engine finish reason type
    command: str = ""
    exit_code: Optional[int] = None
    timed_out: bool = False
    observation: str = ""
    observation_tokens: int = 0


@dataclass
class Episode:
    """A played episode: token arrays for the trainer plus what happened."""
    task_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    answer: Optional[str] = None
    end_reason: str = ""             # answer | max_turns | max_tokens | context | no_action
    versions: list[int] = field(default_factory=list)  # engine weight version of each turn
    gen_s: float = 0.0
    sandbox_s: float = 0.0
    # Filled in by scoring:
    success: bool = False
    reward: float = 0.0
    advantage: float = 0.0
    weight: float = 1.0
    verdict_notes: list[str] = field(default_factory=list)
    failed: Optional[str] = None     # failure reason when the episode is excluded
    error: str = ""

    @property
    def policy_version(self) -> int:
        """Oldest weight version any of its model tokens came from."""
        return min(self.versions) if self.versions else 0

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def commands(self) -> list[TurnRecord]:
        return [t for t in self.turns if t.action == "bash"]

    @property
    def format_violations(self) -> int:
        return sum(1 for t in self.turns if t.action == "none")


def _version(meta: dict[str, Any], fallback: int) -> int:
    try:
        return int(str(meta.get("weight_version", fallback)))
    except ValueError:
        return fallback


def _check_reply(reply: Any) -> tuple[list[int], list[float], str, dict]:
    if not isinstance(reply, dict) or "output_ids" not in reply or "meta_info" not in reply:
        raise EpisodeFailed("engine_malformed", f"reply lacks output_ids/meta_info: {str(reply)[:200]}")
    meta = reply["meta_info"]
    ids = [int(i) for i in reply["output_ids"]]
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(ids):
        raise EpisodeFailed("engine_malformed",
                            f"{len(ids)} output ids but {len(entries)} output_token_logprobs")
    lps = []
    for (lp, tid, *_), want in zip(entries, ids):
        if int(tid) != want or lp is None:
            raise EpisodeFailed("engine_malformed", "output_token_logprobs do not match output_ids")
        lps.append(float(lp))
    finish = (meta.get("finish_reason") or {}).get("type", "")
    return ids, lps, finish, meta


class EpisodeRunner:
    """Plays episodes against one engine with one tokenizer's prompt format."""

    def __init__(self, engine: Engine, prompts: PromptBuilder, episode: EpisodeConfig,
                 version_hint: Any = None) -> None:
        self.engine = engine
        self.prompts = prompts
        self.cfg = episode
        self._version_hint = version_hint or (lambda: 0)

    async def _generate(self, ids: list[int], params: dict) -> tuple[list[int], list[float], str, dict]:
        for _ in range(_ABORT_RETRIES):
            rid = uuid.uuid4().hex
            try:
                reply = await asyncio.wait_for(
                    self.engine.generate(ids, params, return_logprob=True, rid=rid),
                    timeout=self.cfg.engine_timeout_s)
            except asyncio.TimeoutError as exc:
                raise EpisodeFailed("engine_timeout", f"no reply in {self.cfg.engine_timeout_s:g}s") from exc
            except EpisodeFailed:
                raise
            except Exception as exc:  # EngineError, connection errors: the engine is at fault
                raise EpisodeFailed("engine_error", f"{type(exc).__name__}: {exc}") from exc
            out = _check_reply(reply)
            if out[2] != "abort":
                return out
            # Aborted by a weight update (pause mode "abort"): replay the turn on the new weights.
        raise EpisodeFailed("engine_abort", f"generation aborted {_ABORT_RETRIES} times in a row")

    async def play(self, task_id: str, instruction: str, sandbox: Executor,
                   sampling: SamplingConfig, greedy: bool = False) -> Episode:
        """Play one episode in `sandbox`; raise EpisodeFailed when it cannot be played."""
        cfg = self.cfg
        ep = Episode(task_id=task_id, prompt_ids=self.prompts.prompt_ids(instruction))
        base = {"temperature": 0.0 if greedy else sampling.temperature,
                "top_p": 1.0 if greedy else sampling.top_p,
                "stop": list(STOP_STRINGS), "stop_token_ids": list(self.prompts.eos_ids)}
        n_prompt = len(ep.prompt_ids)
        if n_prompt >= cfg.context_limit:
            raise EpisodeFailed("prompt_too_long", f"prompt has {n_prompt} tokens, context_limit "
                                                   f"{cfg.context_limit}")
        for _ in range(cfg.max_turns):
            used = len(ep.response_ids)
            budget = min(sampling.max_new_tokens, cfg.max_response_tokens - used,
                         cfg.context_limit - n_prompt - used)
            if budget < 1:
                ep.end_reason = "context" if cfg.context_limit - n_prompt - used < 1 else "max_tokens"
                return ep
            t0 = time.perf_counter()
            ids, lps, finish, meta = await self._generate(ep.prompt_ids + ep.response_ids,
                                                          {**base, "max_new_tokens": budget})
            ep.gen_s += time.perf_counter() - t0
            ep.response_ids += ids
            ep.loss_mask += [1] * len(ids)
            ep.logprobs += lps
            ep.versions.append(_version(meta, self._version_hint()))
            text = self.prompts.tok.decode(ids, skip_special_tokens=False)
            action = parse_action(text)
            turn = TurnRecord(action=action.kind, text=text, generated=len(ids), finish=finish)
            ep.turns.append(turn)
            if action.kind == "answer":
                ep.answer = action.text
                ep.end_reason = "answer"
                return ep
            if action.kind == "none":
                ep.end_reason = "max_tokens" if finish == "length" else "no_action"
                return ep
            turn.command = action.text
            t0 = time.perf_counter()
            try:
                result = await sandbox.run(action.text, cfg.command_timeout_s, cfg.output_cap_bytes)
            except SandboxError as exc:
                raise EpisodeFailed("sandbox_error", str(exc)) from exc
            ep.sandbox_s += time.perf_counter() - t0
            turn.exit_code, turn.timed_out = result.exit_code, result.timed_out
            turn.observation = format_observation(result, cfg.command_timeout_s, cfg.output_cap_bytes)
            obs_ids = self.prompts.tool_turn_ids(turn.observation, self.prompts.ends_with_eos(ids))
            total = n_prompt + len(ep.response_ids) + len(obs_ids)
            if total >= cfg.context_limit or len(ep.response_ids) + len(obs_ids) >= cfg.max_response_tokens:
                ep.end_reason = "context" if total >= cfg.context_limit else "max_tokens"
                return ep
            turn.observation_tokens = len(obs_ids)
            ep.response_ids += obs_ids
            ep.loss_mask += [0] * len(obs_ids)
            ep.logprobs += [0.0] * len(obs_ids)
        ep.end_reason = "max_turns"
        return ep
