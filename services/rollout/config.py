"""Typed run configuration: what a user POSTs to /runs (or passes to StartRun).

Every section forbids unknown fields, so a misspelt key is rejected with an
error that names it (HTTP 422, gRPC INVALID_ARGUMENT) instead of being ignored.
"""
from __future__ import annotations

import json
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingConfig(_Strict):
    """Engine sampling for training episodes (evaluation is always greedy)."""
    temperature: float = Field(1.0, gt=0.0, le=5.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(96, ge=1, le=8192, description="cap per assistant turn")


class PromptConfig(_Strict):
    """The agent prompt (rendered with the model's own chat template)."""
    examples: int = Field(3, ge=0, le=3, description="worked examples shown before the task (0-3)")
    system_prompt: Optional[str] = Field(None, description="replaces the built-in system prompt")


class EpisodeConfig(_Strict):
    """Limits of one multi-turn episode."""
    max_turns: int = Field(4, ge=1, le=64, description="assistant turns before the episode is cut")
    max_response_tokens: int = Field(768, ge=16, description="model + observation tokens after the prompt")
    context_limit: int = Field(2048, ge=64, description="prompt + response tokens never exceed this")
    command_timeout_s: float = Field(10.0, gt=0, le=600, description="wall-clock limit of one command")
    output_cap_bytes: int = Field(1024, ge=64, le=1 << 20, description="observation bytes kept per stream")
    engine_timeout_s: float = Field(300.0, gt=0, description="one /generate call may take this long")


class RewardConfig(_Strict):
    """Reward = success * verifier + shaping; all weights configurable."""
    success: float = Field(1.0, description="added when the verifier passes")
    ok_command: float = Field(0.1, description="added per command that exits 0")
    ok_command_cap: float = Field(0.3, ge=0, description="cap of the summed ok_command bonus")
    timeout_penalty: float = Field(-0.1, le=0, description="added per command that timed out")
    error_penalty: float = Field(-0.05, le=0, description="added per command that exits non-zero")
    format_penalty: float = Field(-0.2, le=0, description="added once if a turn had no valid action")
    no_answer_penalty: float = Field(0.0, le=0, description="added when the episode ends without <answer>")


class AdvantageConfig(_Strict):
    """GRPO group advantages A = (R - mean) / (std + eps)."""
    eps: float = Field(1e-4, gt=0)
    drop_zero_variance: bool = Field(False, description="drop groups whose rewards are all equal")
    dynamic_sampling: bool = Field(False, description="play extra groups to replace dropped ones")
    max_extra_rounds: int = Field(2, ge=0, le=10, description="rounds of dynamic sampling per step")


class AsyncConfig(_Strict):
    """Bounded-staleness asynchronous mode."""
    staleness_k: int = Field(1, ge=0, description="episodes older than k policy versions are handled by `stale`")
    stale: Literal["drop", "downweight"] = "drop"
    downweight: float = Field(0.5, gt=0, le=1, description="loss weight per version of staleness (downweight)")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "in_place", description="engine pause mode while the weights are swapped")


class LossConfig(_Strict):
    """Passed to the trainer's TrainStep; None keeps the trainer's default."""
    lr: Optional[float] = Field(1e-6, gt=0)
    eps_low: Optional[float] = Field(None, ge=0)
    eps_high: Optional[float] = Field(None, ge=0)
    dual_clip_c: Optional[float] = Field(None, ge=0)
    aggregation: Optional[Literal["token_mean", "seq_mean"]] = None
    kl_coef: Optional[float] = Field(None, ge=0)
    tis_cap: Optional[float] = Field(None, ge=0)


class SandboxConfig(_Strict):
    template: str = Field("", description="sandbox template; empty for the service default")
    timeout_s: int = Field(600, ge=10, description="time to live of each episode sandbox")
    fork: bool = Field(True, description="prepare one sandbox per group and fork it (falls back to create)")


class EvalConfig(_Strict):
    """Periodic greedy evaluation on held-out tasks."""
    every: int = Field(0, ge=0, description="evaluate every N steps (and at the end); 0 disables")
    split: str = Field("eval", description="task split to evaluate on")
    tasks: list[str] = Field(default_factory=list, description="task ids; empty for the whole split")
    limit: int = Field(0, ge=0, description="evaluate at most this many tasks; 0 for all")
    at_start: bool = Field(True, description="also evaluate before the first step")


class RunConfig(_Strict):
    """Everything a run needs. POST /runs takes this as JSON; StartRun as JSON or YAML text."""
    name: str = Field("", max_length=200)
    model: str = Field("SmolLM2-135M-Instruct", description="tokenizer (and model) the engine serves")
    engine_url: Optional[str] = Field(None, description="overrides the orchestrator's --engine-url")
    trainer_addr: Optional[str] = Field(None, description="overrides --trainer-addr")
    sandbox_addr: Optional[str] = Field(None, description="overrides --sandbox-addr")
    startup_timeout_s: float = Field(300.0, gt=0, description="wait this long for the services to be ready")
    mode: Literal["sync", "async"] = "sync"
    steps: int = Field(2, ge=1, le=100000)
    seed: int = 0
    split: str = Field("train", description="task split to train on")
    tasks: list[str] = Field(default_factory=list, description="task ids; empty for the whole split")
    prompts_per_step: int = Field(2, ge=1, description="distinct tasks per step")
    group_size: int = Field(4, ge=1, le=256, description="episodes per task (GRPO group)")
    concurrency: int = Field(8, ge=1, le=1024, description="episodes in flight at once")
    min_ok_fraction: float = Field(0.5, ge=0, le=1, description="a step fails if fewer episodes succeed")
    step_retries: int = Field(1, ge=0, le=10, description="replay a step's generation this often before failing")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    asynchronous: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    loss: LossConfig = Field(default_factory=LossConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sync_method: str = Field("", description="trainer SyncWeights method; empty for its default")
    checkpoint_every: int = Field(0, ge=0, description="SaveCheckpoint every N steps; 0 only at the end")
    resume: bool = Field(False, description="LoadCheckpoint (latest) before the first step")
    samples_per_step: int = Field(4, ge=0, description="episodes per step written to samples.jsonl")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.episode.max_response_tokens >= self.episode.context_limit:
            raise ValueError("episode.max_response_tokens must be below episode.context_limit")
        return self


class ConfigError(ValueError):
    """A run config that cannot be parsed or validated; the message names the field."""


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: `field.path: message`."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def parse_config(text: str) -> RunConfig:
    """Parse a run config from JSON or YAML text; raise ConfigError naming the bad field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config is neither JSON nor YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    if "run" in data and "services" in data:  # a whole configs/*.yaml file
        data = data["run"] or {}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
