"""CUDA-graph decode: replay one captured decode step per (batch bucket, length bucket).

A decode step of a small model is hundreds of tiny kernels; launching them
from Python dominates its time on a GPU. Each graph runs `decode_rows` over
slots [0, B) attending to positions [0, L): the running requests sit in their
own slots (the scheduler hands out the lowest free slot, so they fit under B),
the other rows are padding (token 0 at position 0 of a free slot) and their
logits are dropped. Inputs go through fixed buffers; graphs are captured
lazily on first use and dropped when the cache is reallocated. Weight updates
copy into the parameters in place, so graphs keep seeing current weights.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.engine.model import ModelRunner

log = logging.getLogger(__name__)


class GraphDecoder:
    def __init__(self, runner: "ModelRunner", min_len: int = 64, capture: bool = True) -> None:
        """`capture=False` runs the same padded-bucket step without graphs (to test the bucketing on CPU)."""
        self.runner = runner
        self.capture = capture
        self.min_len = min_len
        n = runner.max_slots
        self.inputs = torch.zeros(2, n, dtype=torch.long, device=runner.device)  # token ids, positions
        self.tok, self.pos = self.inputs[0], self.inputs[1]
        self.batch_buckets = sorted({b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < n} | {n})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.failed = False

    def clear(self) -> None:
        self.graphs.clear()

    def _len_bucket(self, length: int) -> int:
        size = self.min_len
        while size < length:
            size *= 2
        return min(size, self.runner.capacity)

    def decode(self, slots: list[int], tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor | None:
        """Logits for the given rows, or None when graphs are unusable (the caller decodes eagerly)."""
        if self.failed:
            return None
        if self.runner.device.type != "cuda":
            return self._decode(slots, tokens, positions)
        # Capture and replay use the current device's streams: pin it to the engine's card, which need
        # not be the calling thread's current device (e.g. --device cuda:1 in a process seeing both GPUs).
        with torch.cuda.device(self.runner.device):
            return self._decode(slots, tokens, positions)

    def _decode(self, slots: list[int], tokens: list[int] | torch.Tensor,
                positions: list[int]) -> torch.Tensor | None:
        b = next(x for x in self.batch_buckets if x >= max(slots) + 1)
        length = self._len_bucket(max(positions) + 1)
        n = len(slots)
        on_device = isinstance(tokens, torch.Tensor)
        if slots == list(range(n)):
            pad = [0] * (b - n)
            host = torch.tensor([[0] * b if on_device else tokens + pad, positions + pad], dtype=torch.long)
            index = slice(0, n)
        else:
            tok, pos = [0] * b, [0] * b
            for i, (slot, p) in enumerate(zip(slots, positions)):
                tok[slot], pos[slot] = (0 if on_device else tokens[i]), p
            host = torch.tensor([tok, pos], dtype=torch.long)
            index = torch.tensor(slots).to(self.runner.device, non_blocking=True)  # (device= would sync the stream)
        self.inputs[:, :b].copy_(host, non_blocking=True)  # one host-to-device copy per step
        if on_device:  # the previous step's samples, still on the device: scatter them into the token row
            self.tok[index] = tokens.to(self.runner.device, torch.long)
        if not self.capture:
            return self.runner.decode_rows(self.tok[:b], self.pos[:b], 0, length)[index]
        entry = self.graphs.get((b, length))
        if entry is None:
            try:
                self._capture_all(b, length)
            except Exception:  # keep serving: eager decode is correct, only slower
                log.exception("CUDA graph capture failed (batch %d, length %d); decoding eagerly", b, length)
                self.failed = True
                return None
            entry = self.graphs[(b, length)]
        entry[0].replay()
        return entry[1][index]

    def _capture_all(self, b: int, length: int) -> None:
        """Capture every batch bucket for this length at once, so requests joining later never wait on a capture.

        Rows at or above `b` belong to free slots (running requests sit below b): zero their inputs so the
        warm-up runs write only position 0 of free slots.
        """
        self.inputs[:, b:].zero_()
        for bucket in self.batch_buckets:
            if (bucket, length) not in self.graphs:
                self._capture(bucket, length)

    def _capture(self, b: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        r = self.runner
        stream = torch.cuda.Stream(r.device)
        stream.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(stream):  # warm-up: writes the same keys/values the real step writes
            for _ in range(2):
                r.decode_rows(self.tok[:b], self.pos[:b], 0, length)
        torch.cuda.current_stream(r.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = r.decode_rows(self.tok[:b], self.pos[:b], 0, length)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(b, length)] = (graph, out)
        log.info("captured decode graph: batch %d, length %d", b, length)
        return graph, out
