"""FP32 log-probs of response tokens without ever holding a full [B, L, V] fp32 tensor.

The decoder runs once over right-padded sequences (causal attention makes the
padding invisible to real tokens, so no attention mask is needed). Hidden
states at positions [P-1 : P+R-1] of each sequence are gathered into one
[T, H] matrix: the logits at position t-1 predict token t. The vocabulary
projection, the division by the temperature and the fp32 log-softmax then run
over chunks of those T rows, each chunk under activation checkpointing so that
the backward pass keeps only the [chunk, H] input and recomputes the logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.common.numerics import project_logits
from services.trainer import invariant_forward


@dataclass
class PackedInputs:
    """Inputs of one micro-batch, built by `pack_sequences`."""

    input_ids: torch.Tensor   # int64 [B, Lmax], right-padded
    gather_index: torch.Tensor  # int64 [T]: flat positions (b * Lmax + t) of the predicting hidden states
    targets: torch.Tensor     # int64 [T]: the response tokens they predict
    response_lens: list[int]  # R per sequence, in order


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   pad_id: int, device: torch.device | str) -> PackedInputs:
    """Right-pad prompt+response sequences and index the hidden states that predict responses.

    The last response token is never an input, so each row holds P + R - 1 tokens.
    """
    rows = [list(p) + list(r)[:-1] for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    gather, targets, rlens = [], [], []
    for b, (p, r, row) in enumerate(zip(prompts, responses, rows)):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        start = len(p) - 1
        gather.append(torch.arange(start, start + len(r), dtype=torch.long) + b * width)
        targets.append(torch.as_tensor(list(r), dtype=torch.long))
        rlens.append(len(r))
    return PackedInputs(input_ids=ids.to(device), gather_index=torch.cat(gather).to(device),
                        targets=torch.cat(targets).to(device), response_lens=rlens)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, temperature: float,
                    fp32_head: bool = False, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # divided, as the engine does: the same rounding as its sampling logits
    logits = project_logits(hidden, weight, fp32=fp32_head, batch_invariant=invariant) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class PolicyModel(nn.Module):
    """Wraps a Hugging Face causal LM so that one forward returns per-token log-probs.

    Being one module matters under FSDP2: its root hooks gather the embedding,
    final norm and vocabulary projection before this forward runs.
    """

    def __init__(self, lm: nn.Module, chunk_bytes: int = 128 << 20, fp32_head: bool = False,
                 batch_invariant: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_bytes = chunk_bytes
        # fp32 logits (services.common.numerics): not rounded to bf16, as an engine started with
        # --enable-fp32-lm-head computes them.
        self.fp32_head = fp32_head
        # the forward of services.trainer.invariant_forward: bitwise the log-probs of an engine started
        # with --enable-deterministic-inference
        self.batch_invariant = batch_invariant
        if batch_invariant:
            invariant_forward.check_supported(lm)
        self.checkpoint_layers = any(getattr(m, "gradient_checkpointing", False) for m in lm.modules())

    @property
    def vocab_size(self) -> int:
        return self.lm.get_output_embeddings().weight.shape[0]

    def chunk_rows(self) -> int:
        """Rows per log-softmax chunk so that one fp32 [rows, V] block stays under chunk_bytes."""
        return max(16, self.chunk_bytes // (4 * self.vocab_size))

    def forward(self, input_ids: torch.Tensor, gather_index: torch.Tensor, targets: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (log-probs [T] fp32 with grad, entropies [T] fp32 without)."""
        if self.batch_invariant:
            hidden = invariant_forward.decoder_hidden(self.lm, input_ids, self.checkpoint_layers)
        else:
            hidden = self.lm.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather_index)
        weight = self.lm.get_output_embeddings().weight
        args = (weight, float(temperature), self.fp32_head, self.batch_invariant)
        rows = self.chunk_rows()
        logps, ents = [], []
        for s in range(0, flat.shape[0], rows):
            h, t = flat[s:s + rows], targets[s:s + rows]
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_chunk_logprobs, h, t, *args, use_reentrant=False)
            else:
                lp, ent = _chunk_logprobs(h, t, *args)
            logps.append(lp)
            ents.append(ent)
        return torch.cat(logps), torch.cat(ents)
