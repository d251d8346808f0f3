"""Token-in/token-out episodes with the real SmolLM2 tokenizer and a scripted engine."""
from __future__ import annotations

import pytest

from services.rollout.config import EpisodeConfig, SamplingConfig
from services.rollout.episode import EpisodeFailed, EpisodeRunner
from services.rollout.prompt import PromptBuilder, parse_action
from tests.rollout.fakes import FakeEngine, LocalSandbox


def scripted(*replies: str):
    """A policy that returns the given replies in order."""
    it = iter(replies)
    return lambda context: next(it)


@pytest.fixture
def sandbox():
    sb = LocalSandbox()
    yield sb
    sb.close()


async def test_sequence_is_exactly_what_the_engine_produced_and_saw(smol_tokenizer, sandbox):
    engine = FakeEngine(smol_tokenizer, scripted("Let me look.<bash>echo hi; false</bash>",
                                                 "<answer>hi</answer>"))
    prompts = PromptBuilder(smol_tokenizer)
    runner = EpisodeRunner(engine, prompts, EpisodeConfig())
    ep = await runner.play("t", "Say hi.", sandbox, SamplingConfig())

    assert ep.end_reason == "answer" and ep.answer == "hi"
    assert ep.prompt_ids == prompts.prompt_ids("Say hi.")
    # Turn 1 got exactly the prompt; turn 2 got exactly prompt + everything appended since.
    assert engine.calls[0]["input_ids"] == ep.prompt_ids
    n1 = len(engine.calls[1]["input_ids"]) - len(ep.prompt_ids)
    assert engine.calls[1]["input_ids"] == ep.prompt_ids + ep.response_ids[:n1]
    assert len(ep.response_ids) == len(ep.loss_mask) == len(ep.logprobs)
    # Model tokens carry mask 1 and the engine's log-prob; observation tokens mask 0 and log-prob 0.
    for m, lp in zip(ep.loss_mask, ep.logprobs):
        assert (m, lp) in ((1, -0.25), (0, 0.0))
    gen1 = smol_tokenizer.encode("Let me look.<bash>echo hi; false</bash>", add_special_tokens=False)
    assert ep.response_ids[:len(gen1)] == gen1
    obs = ep.response_ids[len(gen1):n1]
    assert set(ep.loss_mask[len(gen1):n1]) == {0}
    obs_text = smol_tokenizer.decode(obs, skip_special_tokens=False)
    assert obs_text == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nhi\n[exit code 1]\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ep.turns[0].command == "echo hi; false" and ep.turns[0].exit_code == 1
    assert sandbox.commands == ["echo hi; false"]
    # Stop strings and EOS go to the engine; the model's closing tags stay in its own tokens.
    params = engine.calls[0]["sampling_params"]
    assert "</bash>" in params["stop"] and params["stop_token_ids"] == [2]


async def test_model_closing_its_turn_is_not_closed_twice(smol_tokenizer, sandbox):
    class EosEngine(FakeEngine):
        async def generate(self, input_ids, sampling_params, **kw):
            reply = await super().generate(input_ids, sampling_params, **kw)
            if len(self.calls) == 1:  # the model emitted <|im_end|> right after its command
                reply["output_ids"].append(2)
                reply["meta_info"]["output_token_logprobs"].append([-0.1, 2, None])
            return reply

    engine = EosEngine(smol_tokenizer, scripted("<bash>echo ok</bash>", "<answer>ok</answer>"))
    ep = await EpisodeRunner(engine, PromptBuilder(smol_tokenizer), EpisodeConfig()).play(
        "t", "x", sandbox, SamplingConfig())
    text = smol_tokenizer.decode(ep.response_ids, skip_special_tokens=False)
    assert "</bash><|im_end|>\n<|im_start|>user" in text
    assert "<|im_end|><|im_end|>" not in text


async def test_ends_on_max_turns_and_on_missing_action(smol_tokenizer, sandbox):
    engine = FakeEngine(smol_tokenizer, lambda ctx: "<bash>echo again</bash>")
    runner = EpisodeRunner(engine, PromptBuilder(smol_tokenizer), EpisodeConfig(max_turns=3))
    ep = await runner.play("t", "loop", sandbox, SamplingConfig())
    assert ep.end_reason == "max_turns" and len(ep.turns) == 3 and ep.answer is None

    engine = FakeEngine(smol_tokenizer, lambda ctx: "I think the answer is 4.")
    ep = await EpisodeRunner(engine, PromptBuilder(smol_tokenizer), EpisodeConfig()).play(
        "t", "x", sandbox, SamplingConfig())
    assert ep.end_reason == "no_action" and ep.format_violations == 1
    assert ep.response_ids[-1] == 2  # the EOS the engine produced is kept, with mask 1
    assert ep.loss_mask[-1] == 1


async def test_token_budgets_are_respected(smol_tokenizer, sandbox):
    engine = FakeEngine(smol_tokenizer, lambda ctx: "word " * 200)
    cfg = EpisodeConfig(max_response_tokens=40, context_limit=1024)
    ep = await EpisodeRunner(engine, PromptBuilder(smol_tokenizer), cfg).play(
        "t", "x", sandbox, SamplingConfig(max_new_tokens=64))
    assert engine.calls[0]["sampling_params"]["max_new_tokens"] == 40
    assert len(ep.response_ids) == 40 and ep.end_reason == "max_tokens"

    prompt_len = len(PromptBuilder(smol_tokenizer).prompt_ids("x"))
    engine = FakeEngine(smol_tokenizer, lambda ctx: "<bash>seq 1 400</bash>")
    cfg = EpisodeConfig(max_response_tokens=100, context_limit=prompt_len + 120, max_turns=8)
    ep = await EpisodeRunner(engine, PromptBuilder(smol_tokenizer), cfg).play(
        "t", "x", sandbox, SamplingConfig(max_new_tokens=64))
    assert len(ep.prompt_ids) + len(ep.response_ids) <= cfg.context_limit
    assert len(ep.response_ids) <= cfg.max_response_tokens
    assert ep.end_reason in ("context", "max_tokens")


async def test_engine_faults_become_episode_failures(smol_tokenizer, sandbox):
    class Broken(FakeEngine):
        async def generate(self, input_ids, sampling_params, **kw):
            reply = await super().generate(input_ids, sampling_params, **kw)
            reply["meta_info"]["output_token_logprobs"] = reply["meta_info"]["output_token_logprobs"][:-1]
            return reply

    runner = EpisodeRunner(Broken(smol_tokenizer, lambda c: "<answer>1</answer>"),
                           PromptBuilder(smol_tokenizer), EpisodeConfig())
    with pytest.raises(EpisodeFailed) as err:
        await runner.play("t", "x", sandbox, SamplingConfig())
    assert err.value.reason == "engine_malformed"

    slow = FakeEngine(smol_tokenizer, lambda c: "<answer>1</answer>")
    slow.delay_s = 0.5
    runner = EpisodeRunner(slow, PromptBuilder(smol_tokenizer), EpisodeConfig(engine_timeout_s=0.05))
    with pytest.raises(EpisodeFailed) as err:
        await runner.play("t", "x", sandbox, SamplingConfig())
    assert err.value.reason == "engine_timeout"


async def test_aborted_turn_is_replayed_not_kept(smol_tokenizer, sandbox):
    engine = FakeEngine(smol_tokenizer, lambda c: "<answer>1</answer>")
    engine.abort_next = 1
    ep = await EpisodeRunner(engine, PromptBuilder(smol_tokenizer), EpisodeConfig()).play(
        "t", "x", sandbox, SamplingConfig())
    assert len(engine.calls) == 2 and engine.calls[0]["input_ids"] == engine.calls[1]["input_ids"]
    assert ep.answer == "1" and ep.end_reason == "answer"
    assert len(ep.response_ids) == len(smol_tokenizer.encode("<answer>1</answer>", add_special_tokens=False))


async def test_greedy_uses_temperature_zero(smol_tokenizer, sandbox):
    engine = FakeEngine(smol_tokenizer, lambda c: "<answer>1</answer>")
    await EpisodeRunner(engine, PromptBuilder(smol_tokenizer), EpisodeConfig()).play(
        "t", "x", sandbox, SamplingConfig(temperature=0.8), greedy=True)
    assert engine.calls[0]["sampling_params"]["temperature"] == 0.0


def test_parse_action():
    assert parse_action("ok <bash> ls -l </bash> tail").text == "ls -l"
    assert parse_action("<answer>42</answer>").kind == "answer"
    assert parse_action("<bash></bash>").kind == "none"
    assert parse_action("<bash>ls").kind == "none"
    assert parse_action("<answer>a</answer><bash>ls</bash>").kind == "answer"
