"""The policy trainer: one optimisation step over a checked batch, and the weights it holds.

`PolicyTrainer.train_step` runs micro-batches (packed by a token budget),
accumulates gradients of the batch loss, clips them, and steps AdamW. The
step is all-or-nothing: a non-finite loss or gradient discards the gradients
and leaves weights, optimiser state and step count untouched.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from services.common import batch_invariant
from services.trainer.batch import BatchError, EpisodeArrays, plan_micro_batches
from services.trainer.logprobs import PolicyModel, pack_sequences
from services.trainer.losses import LossSettings, policy_loss, token_weights
from services.trainer.optim import MasterAdamW
from services.trainer.param_arena import ParamArena

log = logging.getLogger(__name__)


@dataclass
class TrainerSettings:
    """Trainer-wide settings (CLI flags)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 8192
    logprob_chunk_mb: int = 128
    fp32_lm_head: bool = False
    batch_invariant: bool = False  # the forward of services.trainer.invariant_forward (single process)
    param_arena: bool = True      # parameters in one flat buffer per dtype: weight sync without flatten
    optimizer_offload: bool = False
    kl_reference: bool = False
    max_seq_len: int = 0          # 0: the model's max_position_embeddings
    loss: LossSettings = field(default_factory=LossSettings)


class NonFiniteStep(RuntimeError):
    """The loss or the gradient was not finite; the step was discarded."""


class PolicyTrainer:
    """Holds the model and optimiser; `train_step` and `named_weights` are thread-safe."""

    def __init__(self, model: nn.Module, device: str, settings: TrainerSettings,
                 model_name: str = "", pad_id: int | None = None,
                 prepare: Callable[[PolicyModel], None] | None = None) -> None:
        """`prepare` runs on the PolicyModel before the optimiser is built (FSDP2 sharding)."""
        self.device = torch.device(device)
        self.settings = settings
        self.model_name = model_name
        self.lm = model
        self.policy = self._policy_model(model)
        cfg = model.config
        self.vocab_size = self.policy.vocab_size
        self.max_len = settings.max_seq_len or int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.pad_id = pad_id if pad_id is not None else int(getattr(cfg, "pad_token_id", None) or 0)
        self.dtype = next(model.parameters()).dtype
        self.reference: PolicyModel | None = None
        if settings.kl_reference:  # a full, frozen copy on every rank (before any sharding)
            ref = copy.deepcopy(model).eval()
            ref.requires_grad_(False)
            self.reference = self._policy_model(ref)
        if prepare is not None:
            prepare(self.policy)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if settings.batch_invariant and self.world > 1:
            raise ValueError("--batch-invariant runs a single-process forward; it does not combine with FSDP")
        if settings.batch_invariant and (not batch_invariant.kernels_available(self.device)
                                         or self.dtype == torch.float32):
            log.warning("--batch-invariant on %s %s: the torch formulas run instead of the batch-invariant kernels "
                        "(those need CUDA, triton and a 16-bit dtype)", self.device, self.dtype)
        self.arena: ParamArena | None = None
        if settings.param_arena and self.world == 1:
            try:
                self.arena = ParamArena.pack(model)
            except ValueError as exc:
                log.info("parameters stay where they are (weight sync will flatten): %s", exc)
        self.optimizer = MasterAdamW(model.named_parameters(), lr=settings.lr, betas=settings.betas,
                                     eps=settings.adam_eps, weight_decay=settings.weight_decay,
                                     offload=settings.optimizer_offload)
        self.step = 0
        self.policy_version = 0
        self.lock = threading.Lock()

    def _policy_model(self, lm: nn.Module) -> PolicyModel:
        s = self.settings
        return PolicyModel(lm, chunk_bytes=s.logprob_chunk_mb << 20, fp32_head=s.fp32_lm_head,
                           batch_invariant=s.batch_invariant)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.lm.parameters())

    def peak_memory_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        return 0.0

    # ---- training ---------------------------------------------------------------------------
    def train_step(self, episodes: Sequence[EpisodeArrays], loss: LossSettings) -> dict[str, float]:
        """One optimiser step over `episodes` (already checked by services.trainer.batch)."""
        loss.validate()
        if loss.kl_coef > 0 and self.reference is None:
            raise BatchError(grpc.StatusCode.FAILED_PRECONDITION,
                             "loss.kl_coef > 0 needs a reference policy: start the trainer with --kl-reference")
        with self.lock:
            return self._train_step(episodes, loss)

    def _train_step(self, episodes: Sequence[EpisodeArrays], loss: LossSettings) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        total_tokens = sum(e.masked_tokens for e in episodes)
        total_eps = sum(1 for e in episodes if e.masked_tokens)
        groups = plan_micro_batches([e.length for e in episodes], self.settings.micro_batch_tokens)
        n_groups = len(groups)
        mine: list[tuple[list[int], float]] = [(g, 1.0) for g in groups]
        if self.world > 1:
            # Every rank runs the same number of forward/backward passes (FSDP collectives must
            # pair up): pad with zero-weighted repeats, then take every world-th group.
            padded = mine + [(groups[0], 0.0)] * (-len(groups) % self.world)
            mine = padded[self.rank::self.world]
        sums = dict(loss=0.0, clip=0.0, dual=0.0, entropy=0.0, kl=0.0, diff=0.0, neg=0.0)
        diff_max = 0.0
        self.optimizer.zero_grad()
        self.policy.train()
        for group, keep in mine:
            eps = [episodes[i] for i in group]
            inputs = pack_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                                    self.pad_id, self.device)
            mask = torch.from_numpy(np.concatenate([e.loss_mask for e in eps])).to(self.device)
            rollout = torch.from_numpy(np.concatenate([e.rollout_logprobs for e in eps])).to(self.device)[mask]
            adv = torch.cat([torch.full((len(e.response_ids),), e.advantage) for e in eps]).to(self.device)[mask]
            # FSDP averages gradients over ranks; the factors already normalise over the whole
            # batch, so scale by the world size to get the sum.
            factor = token_weights([e.masked_tokens for e in eps], [e.weight for e in eps], loss.aggregation,
                                   total_tokens, total_eps, self.device) * (keep * self.world)
            ref = None
            if self.reference is not None and loss.kl_coef > 0:
                with torch.no_grad():
                    ref = self.reference(inputs.input_ids, inputs.gather_index, inputs.targets,
                                         loss.temperature)[0][mask]
            logp_all, entropy_all = self.policy(inputs.input_ids, inputs.gather_index, inputs.targets,
                                                loss.temperature)
            logp, entropy = logp_all[mask], entropy_all[mask]
            out = policy_loss(logp, rollout, adv, loss, ref)
            batch_loss = (out.loss * factor).sum()
            if self.world == 1 and not torch.isfinite(batch_loss):
                self.optimizer.zero_grad()
                raise NonFiniteStep(f"non-finite loss in a micro-batch of episodes {group}; step discarded")
            batch_loss.backward()  # several ranks: a non-finite loss shows in the global grad norm
            if not keep:
                continue
            with torch.no_grad():
                diff = (logp.detach() - rollout).abs()
                n = logp.numel()
                sums["loss"] += batch_loss.item() / self.world
                sums["clip"] += out.clipped.float().sum().item()
                sums["dual"] += out.dual_clipped.float().sum().item()
                sums["neg"] += (adv < 0).float().sum().item()
                sums["entropy"] += entropy.sum().item()
                sums["kl"] += out.kl.detach().sum().item()
                sums["diff"] += diff.sum().item()
                diff_max = max(diff_max, diff.max().item() if n else 0.0)
        if self.world > 1:
            packed = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
            dist.all_reduce(packed)
            sums = dict(zip(sums, packed.tolist()))
            peak = torch.tensor([diff_max], dtype=torch.float64, device=self.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            diff_max = peak.item()
        params = [p for _, p in self.optimizer.params]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.zero_grad()
            raise NonFiniteStep(f"gradient norm is {grad_norm}; step discarded, weights untouched")
        self.optimizer.step(lr=loss.lr)
        self.optimizer.zero_grad()
        self.step += 1
        self.policy_version += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        n = max(total_tokens, 1)
        return {
            "loss": sums["loss"], "clip_frac": sums["clip"] / n, "dual_clip_frac": sums["dual"] / max(sums["neg"], 1),
            "entropy": sums["entropy"] / n, "grad_norm": grad_norm, "kl": sums["kl"] / n,
            "logprob_diff_mean": sums["diff"] / n, "logprob_diff_max": diff_max,
            "tokens": float(total_tokens), "episodes": float(len(episodes)),
            "micro_batches": float(n_groups), "lr": loss.lr, "ranks": float(self.world),
            "step_s": time.perf_counter() - t0, "peak_memory_gb": self.peak_memory_gb(),
        }

    @torch.no_grad()
    def logprobs(self, episodes: Sequence[EpisodeArrays], temperature: float = 1.0) -> list[torch.Tensor]:
        """The trainer's fp32 log-probs of each episode's response tokens (no gradient)."""
        if self.world > 1:
            raise RuntimeError("logprobs() runs in a single process (under FSDP every rank would have to call it)")
        with self.lock:
            self.policy.eval()
            out = []
            for group in plan_micro_batches([e.length for e in episodes], self.settings.micro_batch_tokens):
                eps = [episodes[i] for i in group]
                inputs = pack_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                                        self.pad_id, self.device)
                lp, _ = self.policy(inputs.input_ids, inputs.gather_index, inputs.targets, temperature)
                out.extend(zip(group, lp.split(inputs.response_lens)))
            self.policy.train()
            return [t.cpu() for _, t in sorted(out, key=lambda x: x[0])]

    # ---- weights ----------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (gathered) weights by Hugging Face name; tied weights appear once."""
        for name, p in self.lm.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name, t
