"""AdamW with fp32 master weights and moments, for bf16 (or fp32) parameters.

A bf16 parameter cannot absorb an update smaller than ~1/256 of its value, so
the optimiser keeps an fp32 master copy and fp32 moments, updates those, and
writes the rounded result back into the parameter. The state lives either
beside the parameters (`offload=False`) or in pinned host memory
(`offload=True`); offloaded state is streamed through the parameter's device
in slices of at most `slice_elems` elements, which keeps the accelerator's
share of the optimiser to a few hundred MB. fp32 parameters without offload
are their own master copy.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


class MasterAdamW:
    """AdamW over named parameters (decoupled weight decay, bias correction)."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], lr: float = 1e-6,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, offload: bool = False,
                 slice_elems: int = 8 << 20) -> None:
        self.params = [(n, p) for n, p in named_params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.offload = offload
        self.slice_elems = slice_elems
        self.step_count = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params:
            local = _local(p)
            if offload:
                where = dict(device="cpu", pin_memory=torch.cuda.is_available())
            else:
                where = dict(device=local.device)
            st = {"exp_avg": torch.zeros(local.shape, dtype=torch.float32, **where),
                  "exp_avg_sq": torch.zeros(local.shape, dtype=torch.float32, **where)}
            if offload or local.dtype != torch.float32:
                master = torch.empty(local.shape, dtype=torch.float32, **where)
                master.copy_(local)
                st["master"] = master
            self.state[name] = st

    def zero_grad(self) -> None:
        for _, p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """One AdamW update of every parameter that has a gradient."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        b1, b2 = self.betas
        bc1 = 1 - b1 ** self.step_count
        bc2 = 1 - b2 ** self.step_count
        step_size = lr / bc1
        for name, p in self.params:
            if p.grad is None:
                continue
            st = self.state[name]
            param = _local(p).view(-1)
            grad = _local(p.grad).view(-1)
            m, v = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
            master = st["master"].view(-1) if "master" in st else None
            for s in range(0, param.numel(), self.slice_elems):
                e = min(s + self.slice_elems, param.numel())
                dev = param.device
                ms, vs = m[s:e].to(dev, non_blocking=True), v[s:e].to(dev, non_blocking=True)
                w = master[s:e].to(dev, non_blocking=True) if master is not None else param[s:e]
                g = grad[s:e].float()
                if self.weight_decay:
                    w.mul_(1 - lr * self.weight_decay)
                ms.mul_(b1).add_(g, alpha=1 - b1)
                vs.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (vs / bc2).sqrt_().add_(self.eps)
                w.addcdiv_(ms, denom, value=-step_size)
                if self.offload:
                    m[s:e].copy_(ms, non_blocking=True)
                    v[s:e].copy_(vs, non_blocking=True)
                    master[s:e].copy_(w, non_blocking=True)
                if master is not None:
                    param[s:e].copy_(w)
            p.grad = None  # free each gradient as soon as it is used: lowers the step's peak
        if self.offload and torch.cuda.is_available():
            torch.cuda.synchronize()

    def state_dict(self) -> dict:
        """Moments and master weights (on the CPU), step count and hyper-parameters."""
        return {"step": self.step_count,
                "hyper": {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                          "weight_decay": self.weight_decay},
                "state": {n: {k: t.detach().to("cpu", copy=True) for k, t in st.items()}
                          for n, st in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what `state_dict` returned; raise ValueError on a parameter mismatch."""
        missing = set(self.state) ^ set(sd["state"])
        if missing:
            raise ValueError(f"optimiser state does not match the model: {sorted(missing)[:5]}")
        self.step_count = int(sd["step"])
        for n, st in self.state.items():
            for k, t in st.items():
                src = sd["state"][n].get(k)
                if src is None or src.shape != t.shape:
                    raise ValueError(f"optimiser state {n}.{k} missing or of another shape")
                t.copy_(src)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def total_bytes(opt: MasterAdamW) -> int:
    """Bytes held by the optimiser state."""
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
