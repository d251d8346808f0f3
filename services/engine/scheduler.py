"""Continuous batching: one thread owns the model and runs admit → prefill → decode steps.

Requests join between decode steps (batched, padded prefill into free KV
slots) and leave as soon as they finish, so concurrent requests share every
forward pass. Control operations (weight updates, cache flush, aborts, pause)
are queued to the same thread and run between steps, so a step never sees
weights change under it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import sys
import threading
import time
import uuid
from typing import Any, Callable

import torch

from services.engine.model import ModelRunner
from services.engine.sampling import BatchSampling, SamplingParams, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generation (one prompt × one of its n samples) and its progress."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish: dict | None = None
    finished_len: int | None = None  # output length kept in `text` (stop string trimming)
    slot: int | None = None
    weight_version: str = ""
    created: float = dataclasses.field(default_factory=time.monotonic)
    enqueued: float = 0.0
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output_ids)


class Scheduler:
    """Owns the ModelRunner; everything touching the model runs in its thread."""

    def __init__(self, runner: ModelRunner, eos_ids: set[int], detokenize: Callable[[list[int], SamplingParams], str],
                 max_prefill_tokens: int = 8192, admit_wait_s: float = 0.01, admit_min_tokens: int = 2048) -> None:
        self.runner = runner
        # While requests are decoding, newcomers are gathered for up to admit_wait_s (or until they fill the
        # free slots or admit_min_tokens): one prefill for a burst instead of one per arrival.
        self.admit_wait_s = admit_wait_s
        self.admit_min_tokens = admit_min_tokens
        self.eos_ids = eos_ids
        self.detokenize = detokenize
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(runner.max_slots))
        self.paused = False
        self.weight_version = "default"
        self._control: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.steps = 0
        self.generated_tokens = 0

    # ---- called from other threads --------------------------------------------------------
    def start(self) -> None:
        # The step loop is Python that rarely blocks; a short GIL switch interval keeps the HTTP
        # thread parsing new requests promptly instead of waiting 5 ms per hand-over.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=30)

    def submit(self, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        for seq in seqs:
            seq.enqueued = now
        with self._wake:
            self.waiting.extend(seqs)
            self._wake.notify_all()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` in the scheduler thread between two steps; the future carries its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._control.append((fn, fut))
            self._wake.notify_all()
        return fut

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.runner.device.type == "cuda":
            # Every launch of this thread (eager kernels, CUDA-graph capture and replay) goes to the
            # engine's card, whatever device the process started on.
            torch.cuda.set_device(self.runner.device)
        while True:
            with self._wake:
                while not self._stop and not self._control and (self.paused or not (self.waiting or self.running)):
                    self._wake.wait(timeout=1.0)
                if self._stop:
                    break
                control = list(self._control)
                self._control.clear()
            for fn, fut in control:
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # reported to the caller; the loop lives on
                    fut.set_exception(exc)
            if self.paused:
                continue
            try:
                self._admit()
                if self.running:
                    self._decode()
            except Exception as exc:  # a broken step fails its requests, never the server
                log.exception("step failed")
                for seq in self.running + list(self.waiting):
                    self._finish(seq, {"type": "abort", "message": f"engine step failed: {exc}"})
                self.waiting.clear()
        for seq in self.running + list(self.waiting):
            self._finish(seq, {"type": "abort", "message": "engine shutting down"})

    def _should_wait_for_more(self) -> bool:
        if not self.running or not self.waiting:
            return False
        if time.monotonic() - self.waiting[0].enqueued >= self.admit_wait_s:
            return False
        if len(self.waiting) >= len(self.free_slots):
            return False
        return sum(s.length for s in self.waiting) < self.admit_min_tokens

    def _admit(self) -> None:
        batch: list[Sequence] = []
        tokens = 0
        with self._wake:
            if self._should_wait_for_more():
                return
            while self.waiting and self.free_slots:
                seq = self.waiting[0]
                if seq.future.done():  # aborted while waiting
                    self.waiting.popleft()
                    continue
                if batch and tokens + seq.length > self.max_prefill_tokens:
                    break
                self.waiting.popleft()
                self.free_slots.sort()
                seq.slot = self.free_slots.pop(0)
                batch.append(seq)
                tokens += seq.length
        if not batch:
            return
        rows = [s.prompt + s.output_ids for s in batch]  # retracted requests resume where they were
        hidden = self.runner.prefill([s.slot for s in batch], rows)
        last = torch.tensor([len(r) - 1 for r in rows], device=hidden.device)
        logits = self.runner.logits(hidden[torch.arange(len(batch), device=hidden.device), last])
        for i, seq in enumerate(batch):
            if seq.return_logprob and seq.input_logprobs is None:
                start = len(seq.prompt) if seq.logprob_start_len < 0 else seq.logprob_start_len
                temp = 1.0 if seq.params.greedy else seq.params.temperature
                seq.input_logprobs = self.runner.input_logprobs(hidden[i], seq.prompt, start, temp)
            seq.weight_version = self.weight_version
        self.running.extend(batch)
        keep = [i for i, s in enumerate(batch) if s.params.max_new_tokens > len(s.output_ids)]
        for i, seq in enumerate(batch):
            if i not in keep:  # max_new_tokens 0: prefill only (input logprobs)
                self._finish(seq, {"type": "length", "length": seq.params.max_new_tokens})
        if keep:
            self._sample_and_append([batch[i] for i in keep], logits[keep] if len(keep) < len(batch) else logits)

    def _decode(self) -> None:
        self.running.sort(key=lambda s: s.slot)
        batch = list(self.running)  # a copy: finishing requests leave self.running while we iterate
        logits = self.runner.decode([s.slot for s in batch], [s.output_ids[-1] for s in batch],
                                    [s.length - 1 for s in batch])
        self._sample_and_append(batch, logits)

    def _sample_and_append(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        self.steps += 1
        settings = BatchSampling.build([s.params for s in batch], [s.length for s in batch],
                                       self.runner.vocab_size, logits.device)
        tokens, logprobs = sample(logits, settings)
        if tokens.is_cuda:  # wait for the GPU with the GIL released, so the HTTP thread keeps admitting requests
            torch.cuda.current_stream(tokens.device).synchronize()
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        for seq, tok, lp in zip(batch, tokens, logprobs):
            seq.output_ids.append(tok)
            seq.output_logprobs.append(lp)
            self.generated_tokens += 1
            reason = self._check_finished(seq, tok)
            if reason is not None:
                self._finish(seq, reason)

    def _check_finished(self, seq: Sequence, tok: int) -> dict | None:
        p = seq.params
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            return {"type": "stop", "matched": tok}
        if p.stop:
            text = self.detokenize(seq.output_ids, p)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                pos, stop = min(hits)
                seq.finished_len = pos  # characters of text kept
                return {"type": "stop", "matched": stop}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if seq.length >= self.runner.context_len:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def _finish(self, seq: Sequence, reason: dict) -> None:
        seq.finish = reason
        self._release(seq)
        if not seq.future.done():
            seq.future.set_result(seq)

    # ---- control operations (run through `call`) ------------------------------------------
    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Abort requested") -> int:
        """Finish matching running or waiting requests with finish_reason abort; returns how many."""
        victims = [s for s in self.running + list(self.waiting)
                   if abort_all or s.rid == rid or s.rid.startswith(f"{rid}#")]
        for seq in victims:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, {"type": "abort", "message": message})
        return len(victims)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")
        elif mode == "retract":
            # Drop their KV; they re-prefill prompt + output so far after continue_generation.
            for seq in sorted(self.running, key=lambda s: s.created, reverse=True):
                self._release(seq)
                self.waiting.appendleft(seq)
        elif mode != "in_place":
            raise ValueError(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def flush_cache(self) -> bool:
        """Free the KV cache memory; refused (False) while requests hold slots, as SGLang does."""
        if self.running:
            return False
        self.runner.reset_cache()
        return True


def new_rid() -> str:
    return uuid.uuid4().hex
