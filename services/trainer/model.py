"""Load the policy: a Hugging Face causal LM on one device, in the training dtype.

bf16 on CUDA, fp32 on the CPU (unless told otherwise). `random_init` builds
the architecture from config.json alone with seeded random weights, for
benchmarks of a model shape whose weights are not on the machine.
"""
from __future__ import annotations

import logging
import pathlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from services.common.model_store import resolve_model

log = logging.getLogger(__name__)


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    """'bfloat16' | 'float32' | 'float16' | None (the device's default)."""
    if not name:
        return default_dtype(device)
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        raise ValueError(f"unknown dtype {name!r}; use bfloat16, float16 or float32") from None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def load_model(name: str | None, device: str, dtype: torch.dtype, random_init: bool = False,
               seed: int = 0, gradient_checkpointing: bool = True) -> tuple[torch.nn.Module, pathlib.Path]:
    """Return (model in train mode on `device`, its folder)."""
    folder = resolve_model(name)
    if random_init:
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.to(device)
    model.config.use_cache = False
    if gradient_checkpointing:
        enable_checkpointing(model)
    model.train()
    log.info("loaded %s (%s, %s, %.1fM parameters%s)", folder, device, dtype,
             sum(p.numel() for p in model.parameters()) / 1e6, ", random init" if random_init else "")
    return model, folder


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing of every decoder layer (non-reentrant)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
