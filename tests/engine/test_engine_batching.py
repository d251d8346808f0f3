"""How the scheduler batches: one prefill pass per burst, the padded token budget, identical greedy output
alone and in a mixed batch, settings reused across steps, and the tail-window stop-string search."""
import concurrent.futures
import dataclasses
import time

import pytest
import torch

from services.engine.model import ModelRunner
from tests.engine.conftest import tiny_llama
from services.engine.sampling import BatchSampling, SamplingParams, sample
from services.engine.scheduler import Scheduler, Sequence


@pytest.fixture(scope="module")
def tiny_runner():
    return ModelRunner(tiny_llama(vocab_size=128, max_positions=512), max_slots=8)


@pytest.fixture
def make_scheduler(tiny_runner):
    started = []

    def make(**kwargs) -> Scheduler:
        tiny_runner.reset_cache()
        sched = Scheduler(tiny_runner, eos_ids=set(), detokenize=lambda ids, p: "", **kwargs)
        sched.start()
        started.append(sched)
        return sched
    yield make
    for sched in started:
        sched.stop()


def _seq(prompt, n=4):
    return Sequence(rid=f"r{len(prompt)}-{prompt[0]}", prompt=list(prompt),
                    params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def _wait(seqs, timeout=60):
    concurrent.futures.wait([s.future for s in seqs], timeout=timeout)
    assert all(s.future.done() for s in seqs)
    return [s.future.result() for s in seqs]


def test_a_burst_is_prefilled_in_one_pass(make_scheduler):
    sched = make_scheduler()
    seqs = [_seq(list(range(1, 1 + n))) for n in (5, 17, 3, 9, 30, 12)]
    sched.submit(seqs)
    for s in _wait(seqs):
        assert s.finish == {"type": "length", "length": 4} and len(s.output_ids) == 4
    assert sched.prefill_passes == 1
    assert sched.prefill_tokens == 5 + 17 + 3 + 9 + 30 + 12
    assert sched.decode_steps == 3  # the prefill samples token 1, three shared steps the rest


def test_an_idle_engine_waits_for_a_trickling_burst(make_scheduler):
    sched = make_scheduler(admit_quiet_s=0.5, admit_wait_s=5.0)
    seqs = [_seq([7, 8, 9, i + 1]) for i in range(4)]
    for s in seqs:  # arrive one by one, each well inside the quiet window
        sched.submit([s])
        time.sleep(0.02)
    _wait(seqs)
    assert sched.prefill_passes == 1


def test_a_busy_engine_gathers_newcomers(make_scheduler):
    sched = make_scheduler(admit_quiet_s=0.0, admit_wait_s=0.15, admit_min_tokens=10_000)
    first = _seq([1, 2, 3], n=480)
    sched.submit([first])
    while not sched.running:
        time.sleep(0.005)
    late = [_seq([4, 5, 6, i + 1]) for i in range(3)]
    for s in late:
        sched.submit([s])
        time.sleep(0.01)
    _wait(late + [first])
    assert sched.prefill_passes == 2  # the first request alone, then the three newcomers together
    assert first.finish == {"type": "length", "length": 480}  # it kept decoding meanwhile


def test_prefill_respects_the_padded_token_budget(make_scheduler):
    sched = make_scheduler(max_prefill_tokens=64)
    seqs = [_seq([i + 1] * 30) for i in range(4)]  # two rows of 30 fit in 64, three do not
    sched.submit(seqs)
    _wait(seqs)
    assert sched.prefill_passes == 2
    long = _seq(list(range(1, 101)))  # longer than the budget: goes alone
    sched.submit([long])
    assert _wait([long])[0].finish["type"] == "length"


def test_reused_sampling_settings_match_a_fresh_build():
    params = [SamplingParams(temperature=0.7, sampling_seed=11), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.9, sampling_seed=5), SamplingParams(temperature=1.3)]
    logits = torch.randn(4, 50)
    cpu = torch.device("cpu")
    stepped = BatchSampling.build(params, [3, 8, 2, 6], 50, cpu).advanced().advanced()
    fresh = BatchSampling.build(params, [5, 10, 4, 8], 50, cpu)
    for row in (0, 2):  # seeded rows: the same noise, so the same token
        assert sample(logits, stepped)[0][row] == sample(logits, fresh)[0][row]
    assert sample(logits, stepped)[0][1] == logits[1].argmax()
    assert torch.equal(stepped.positions, fresh.positions)


def test_stop_string_search_looks_at_the_tail_only(tiny_runner):
    text_of = {i: chr(ord("a") + i % 26) for i in range(128)}
    calls = []

    def detokenize(ids, params):
        calls.append(len(ids))
        return "".join(text_of[i] for i in ids)
    sched = Scheduler(tiny_runner, eos_ids=set(), detokenize=detokenize)
    params = SamplingParams(stop=["xyz"])
    seq = Sequence(rid="s", prompt=[1], params=params, output_ids=[0] * 200)  # "aaaa..."
    assert sched._find_stop(seq) is None
    assert calls == [len("xyz") + 8]  # only the tail was detokenized
    seq.output_ids += [23, 24, 25]  # "...xyz"
    assert sched._find_stop(seq) == "xyz"
    assert seq.finished_len == 200
    short = dataclasses.replace(seq, output_ids=[23, 24, 25, 0])
    assert sched._find_stop(short) == "xyz" and short.finished_len == 0


async def test_greedy_is_identical_alone_and_in_a_mixed_batch(client, tokenizer):
    """CPU fp32: the same prompt gives the same greedy tokens (and logprobs) alone and inside a padded batch."""
    texts = ["Hi", "The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
             "1, 2, 3, 4,", "Once upon a time, in a land far away, there lived a very curious little fox who"]
    prompts = [tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts)
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    solo = [await client.generate(p, params, return_logprob=True) for p in prompts]
    before = (await client.server_info())["internal_states"][0]
    together = await client.generate(prompts, params, return_logprob=True)
    after = (await client.server_info())["internal_states"][0]
    assert after["prefill_passes"] - before["prefill_passes"] == 1  # one padded pass for all five
    for alone, batched in zip(solo, together):
        assert batched["output_ids"] == alone["output_ids"]
        a = [lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _, _ in batched["meta_info"]["output_token_logprobs"]]
        assert b == pytest.approx(a, abs=1e-4)


def _run(runner, seqs, overlap, eos=frozenset()):
    runner.reset_cache()
    sched = Scheduler(runner, eos_ids=set(eos), detokenize=lambda ids, p: "", overlap=overlap)
    sched.start()
    try:
        sched.submit(seqs)
        _wait(seqs)
    finally:
        sched.stop()
    return sched


def _workload():
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    return [Sequence(rid="a", prompt=[3, 1, 4, 1, 5], params=greedy),
            Sequence(rid="b", prompt=list(range(1, 40)), params=dataclasses.replace(greedy, max_new_tokens=7)),
            Sequence(rid="c", prompt=[9] * 500, params=greedy),  # runs into the 512-token context
            Sequence(rid="d", prompt=[2, 7, 1, 8], params=SamplingParams(max_new_tokens=24, sampling_seed=3)),
            Sequence(rid="e", prompt=[6], params=dataclasses.replace(greedy, max_new_tokens=1))]


@pytest.mark.parametrize("layout", ["eager", "graph-buckets"])
def test_overlapped_steps_give_the_same_results(tiny_runner, layout):
    """Launching step N+1 before reading step N (the GPU default) changes no token, logprob or finish reason,
    also through the CUDA-graph step's padded layout (run without graphs here), fed tokens from the device."""
    from services.engine.cuda_graphs import GraphDecoder
    plain = _workload()
    _run(tiny_runner, plain, overlap=False)
    eos = {plain[0].output_ids[5]}  # a token "a" emits mid-way: it must stop there in both modes
    plain = _workload()
    _run(tiny_runner, plain, overlap=False, eos=eos)
    runner = ModelRunner(tiny_runner.model, max_slots=8)
    if layout == "graph-buckets":
        runner.graphs = GraphDecoder(runner, min_len=16, capture=False)
    overlapped = _workload()  # "e", "a" and "b" end early: the rest decode from non-contiguous slots
    sched = _run(runner, overlapped, overlap=True, eos=eos)
    assert plain[0].finish["type"] == "stop" and plain[2].finish == {"type": "length", "length": 12}
    for a, b in zip(plain, overlapped):
        assert (b.output_ids, b.finish) == (a.output_ids, a.finish), a.rid
        assert b.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-5)
    assert sched.generated_tokens == sum(len(s.output_ids) for s in overlapped)


def test_overlapped_abort_and_retract(tiny_runner):
    sched = Scheduler(tiny_runner, eos_ids=set(), detokenize=lambda ids, p: "", overlap=True)
    tiny_runner.reset_cache()
    sched.start()
    try:
        keep, drop = _seq([1, 2, 3], n=300), _seq([4, 5], n=300)
        sched.submit([keep, drop])
        while len(keep.output_ids) < 5:
            time.sleep(0.002)
        assert sched.call(lambda: sched.abort(rid=drop.rid)).result(10) == 1
        assert drop.finish["type"] == "abort" and drop.slot is None
        sched.call(lambda: sched.pause("retract")).result(10)
        held = len(keep.output_ids)
        assert keep.sampled == held and not sched.running  # nothing in flight once paused
        sched.call(sched.resume).result(10)
        _wait([keep])
    finally:
        sched.stop()
    assert keep.finish == {"type": "length", "length": 300} and len(keep.output_ids) == 300
    alone = [_seq([1, 2, 3], n=300)]
    _run(tiny_runner, alone, overlap=False)
    assert keep.output_ids == alone[0].output_ids  # the retracted request resumed exactly where it was
