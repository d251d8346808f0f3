"""Continuous batching: one thread owns the model and runs admit → prefill → decode steps.

Requests join between decode steps (a burst is gathered, then prefilled in one
padded pass into free KV slots) and leave as soon as they finish, so
concurrent requests share every forward pass. On GPU the next step is launched
before the previous one's tokens are read, hiding the Python bookkeeping
behind the GPU. Control operations (weight updates, cache flush, aborts,
pause) are queued to the same thread and run between steps, after the
launched steps are drained, so a step never sees weights change under it.
See services/engine/README.md, "How the scheduler batches".
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
    sampled: int = 0  # output tokens whose sampling was launched (may run ahead of output_ids by one step)
    weight_version: str = ""
    created: float = dataclasses.field(default_factory=time.monotonic)
    enqueued: float = 0.0
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output_ids)


@dataclasses.dataclass
class _Launched:
    """A sampled step whose tokens are (maybe still on their way) to the host."""

    batch: list[Sequence]
    tokens: torch.Tensor  # on the host: int64 ids; from a GPU: int32 [2, rows] of ids and the logprobs' bits
    logprobs: torch.Tensor | None = None  # float32, on the host only
    ready: Any = None  # torch.cuda.Event recorded after the copy from the GPU

    def read(self) -> tuple[list[int], list[float]]:
        if self.logprobs is not None:
            return self.tokens.tolist(), self.logprobs.tolist()
        self.ready.synchronize()  # waits with the GIL released, so the HTTP thread keeps admitting requests
        return self.tokens[0].tolist(), self.tokens[1].view(torch.float32).tolist()


class Scheduler:
    """Owns the ModelRunner; everything touching the model runs in its thread."""

    def __init__(self, runner: ModelRunner, eos_ids: set[int], detokenize: Callable[[list[int], SamplingParams], str],
                 max_prefill_tokens: int = 8192, admit_quiet_s: float = 0.003, admit_wait_s: float = 0.02,
                 admit_min_tokens: int = 2048, overlap: bool | None = None) -> None:
        self.runner = runner
        # Overlap (default on GPU): launch step N+1 before reading step N's tokens on the host, so the
        # Python bookkeeping of one step runs while the GPU computes the next; step N+1's input tokens
        # come from the device (`_last_tokens`, each slot's newest sample), and a row that step N
        # finished (a stop token) wastes one row of step N+1. Without overlap (CPU: no concurrency
        # to gain) each launch is read at once and inputs come from the host, with fewer tiny ops.
        self.overlap = runner.device.type == "cuda" if overlap is None else overlap
        self._last_tokens = torch.zeros(runner.max_slots, dtype=torch.long, device=runner.device)
        self._inflight: list[_Launched] = []
        # Admission (see `_admission_delay`): an idle engine lets a burst of requests finish arriving
        # (no newcomer for admit_quiet_s, at most admit_wait_s) and prefills it in one pass; a busy one
        # keeps decoding and gathers newcomers for up to admit_wait_s (or admit_min_tokens).
        self.admit_quiet_s = admit_quiet_s
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
        self._sampling_key: tuple[Sequence, ...] = ()  # rows of the last sampled step and their settings
        self._sampling: BatchSampling | None = None
        self.steps = 0  # forward passes that sampled tokens (prefills and decode steps)
        self.decode_steps = 0
        self.prefill_passes = 0
        self.prefill_tokens = 0  # real (unpadded) tokens prefilled
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
                while not self._stop and not self._control and not self._inflight:
                    if self.paused or not (self.waiting or self.running):
                        self._wake.wait(timeout=1.0)
                        continue
                    if self.running:
                        break
                    delay = self._admission_delay()  # idle with requests waiting: let the burst arrive
                    if delay <= 0:
                        break
                    self._wake.wait(timeout=delay)  # a newcomer wakes us to recompute
                if self._stop:
                    break
                control = list(self._control)
                self._control.clear()
            try:
                if control or self.paused:
                    self._drain()  # control operations see every launched token processed
                for fn, fut in control:
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # reported to the caller; the loop lives on
                        fut.set_exception(exc)
                if self.paused:
                    continue
                self._step()
            except Exception as exc:  # a broken step fails its requests, never the server
                log.exception("step failed")
                self._inflight = []
                for seq in self.running + list(self.waiting):
                    self._finish(seq, {"type": "abort", "message": f"engine step failed: {exc}"})
                self.waiting.clear()
        self._inflight = []
        for seq in self.running + list(self.waiting):
            self._finish(seq, {"type": "abort", "message": "engine shutting down"})

    def _step(self) -> None:
        """Launch a prefill of newcomers and a decode step of the running rows, then process tokens:
        with overlap those of the previous iteration (the new launches keep the GPU busy meanwhile),
        without it those just launched."""
        if not self.overlap:
            for launch in (self._admit, self._decode):
                step = launch()
                if step is not None:
                    self._complete(step)
            return
        launched = [step for step in (self._admit(), self._decode()) if step is not None]
        previous, self._inflight = self._inflight, launched
        for step in previous:
            self._complete(step)

    def _drain(self) -> None:
        while self._inflight:
            self._complete(self._inflight.pop(0))

    def _admission_delay(self) -> float:
        """Seconds to hold the waiting requests before prefilling them (<= 0: now). Caller holds `_wake`.

        Prefilling a burst one arrival at a time costs a forward pass per arrival, and while the
        scheduler computes it holds the GIL the HTTP thread needs to parse the rest of the burst.
        So an idle engine waits until arrivals pause for admit_quiet_s (bounded by admit_wait_s
        after the first), and a busy one, which keeps decoding meanwhile, admits newcomers every
        admit_wait_s or once they reach admit_min_tokens. Full slots or a full prefill pass admit now.
        """
        if not self.waiting:
            return float("inf")
        if len(self.waiting) >= len(self.free_slots):
            return 0.0
        tokens = sum(s.length for s in self.waiting)
        if tokens >= self.max_prefill_tokens:
            return 0.0
        now = time.monotonic()
        until_max = self.admit_wait_s - (now - self.waiting[0].enqueued)
        if self.running:
            return 0.0 if tokens >= self.admit_min_tokens else until_max
        newest = max(s.enqueued for s in self.waiting)  # retracted requests re-enter at the front
        return min(self.admit_quiet_s - (now - newest), until_max)

    def _take_prefill_batch(self) -> list[Sequence]:
        """Pop waiting requests for one padded prefill pass of at most max_prefill_tokens (rows × longest).

        A single request longer than the budget still goes, alone.
        """
        batch: list[Sequence] = []
        width = 0
        with self._wake:
            if self._admission_delay() > 0:
                return batch
            self.free_slots.sort()
            while self.waiting and self.free_slots:
                seq = self.waiting[0]
                if seq.future.done():  # aborted while waiting
                    self.waiting.popleft()
                    continue
                if batch and (len(batch) + 1) * max(width, seq.length) > self.max_prefill_tokens:
                    break
                self.waiting.popleft()
                seq.slot = self.free_slots.pop(0)
                batch.append(seq)
                width = max(width, seq.length)
        return batch

    def _admit(self) -> _Launched | None:
        batch = self._take_prefill_batch()
        if not batch:
            return None
        rows = [s.prompt + s.output_ids for s in batch]  # retracted requests resume where they were
        hidden = self.runner.prefill([s.slot for s in batch], rows)
        self.prefill_passes += 1
        self.prefill_tokens += sum(len(r) for r in rows)
        last = torch.tensor([len(r) - 1 for r in rows]).to(hidden.device, non_blocking=True)
        logits = self.runner.logits(hidden[torch.arange(len(batch), device=hidden.device), last])
        for i, seq in enumerate(batch):
            seq.sampled = len(seq.output_ids)
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
        if not keep:
            return None
        return self._launch([batch[i] for i in keep], logits[keep] if len(keep) < len(batch) else logits)

    def _decode(self) -> _Launched | None:
        """One decode step over every running row that may still grow (a row whose last token is still in
        flight and will end it by length is left out)."""
        context_len = self.runner.context_len
        batch = sorted((s for s in self.running
                        if s.sampled < s.params.max_new_tokens and len(s.prompt) + s.sampled < context_len),
                       key=lambda s: s.slot)
        if not batch:
            return None
        self.decode_steps += 1
        slots = [s.slot for s in batch]
        positions = [len(s.prompt) + s.sampled - 1 for s in batch]  # where each row's newest token sits
        if not self.overlap:
            return self._launch(batch, self.runner.decode(slots, [s.output_ids[-1] for s in batch], positions))
        # With overlap that token may not have reached the host yet: feed it from the device.
        slot_idx = torch.tensor(slots).to(self.runner.device, non_blocking=True)
        return self._launch(batch, self.runner.decode(slots, self._last_tokens[slot_idx], positions), slot_idx)

    def _launch(self, batch: list[Sequence], logits: torch.Tensor, slot_idx: torch.Tensor | None = None) -> _Launched:
        """Sample one token per row on the device and start its copy to the host."""
        self.steps += 1
        key = tuple(batch)
        if key == self._sampling_key:  # same rows as the last step, each one token further on
            settings = self._sampling.advanced()
        else:
            settings = BatchSampling.build([s.params for s in batch], [len(s.prompt) + s.sampled for s in batch],
                                           self.runner.vocab_size, logits.device)
        self._sampling_key, self._sampling = key, settings
        tokens, logprobs = sample(logits, settings)
        for seq in batch:
            seq.sampled += 1
        if self.overlap:
            if slot_idx is None:
                slot_idx = torch.tensor([s.slot for s in batch]).to(tokens.device, non_blocking=True)
            self._last_tokens[slot_idx] = tokens
        if not tokens.is_cuda:
            return _Launched(batch, tokens, logprobs.float())
        # One device-to-host copy per step: ids and the logprobs' float32 bits side by side as int32,
        # into pinned memory, with an event to wait on instead of a stream sync.
        packed = torch.stack((tokens.to(torch.int32), logprobs.float().view(torch.int32)))
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(batch, host, ready=ready)

    def _complete(self, step: _Launched) -> None:
        """Append a launched step's tokens to its rows and finish the rows that are done."""
        ids, lps = step.read()
        eos, context_len = self.eos_ids, self.runner.context_len
        for seq, tok, lp in zip(step.batch, ids, lps):
            if seq.finish is not None or seq.slot is None:
                continue  # finished or aborted while this step ran: its row was wasted work
            out = seq.output_ids
            out.append(tok)
            seq.output_logprobs.append(lp)
            self.generated_tokens += 1
            p = seq.params
            if (p.stop or len(out) >= p.max_new_tokens or len(seq.prompt) + len(out) >= context_len
                    or (not p.ignore_eos and (tok in eos or tok in p.stop_token_ids))):
                reason = self._check_finished(seq, tok)
                if reason is not None:
                    self._finish(seq, reason)

    def _check_finished(self, seq: Sequence, tok: int) -> dict | None:
        p = seq.params
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            return {"type": "stop", "matched": tok}
        if p.stop:
            stop = self._find_stop(seq)
            if stop is not None:
                return {"type": "stop", "matched": stop}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if seq.length >= self.runner.context_len:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _find_stop(self, seq: Sequence) -> str | None:
        """The stop string the newest token completed, if any; sets `finished_len` (characters kept).

        Earlier steps found no stop string, so a new match ends in the newest tokens: detokenize
        only a tail window first (every token is at least one byte of text, so a window of the
        longest stop string's bytes plus a margin covers it), and the whole output only on a hit,
        instead of detokenizing everything generated so far at every step.
        """
        p = seq.params
        window = max(len(s.encode()) for s in p.stop) + 8
        if len(seq.output_ids) > window:
            tail = self.detokenize(seq.output_ids[-window:], p)
            if not any(s in tail for s in p.stop):
                return None
        text = self.detokenize(seq.output_ids, p)
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if not hits:
            return None
        pos, stop = min(hits)
        seq.finished_len = pos
        return stop

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
