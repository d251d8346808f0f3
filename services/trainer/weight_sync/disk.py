"""Weight push through the file system: write a safetensors model folder, then
POST /update_weights_from_disk. Works across hosts that share a file system.

The folder `<root>/<weight_version>` holds `model.safetensors` and the model's
`config.json`, so it is a loadable Hugging Face folder; older sync folders
are removed once the engines have loaded the new one.
"""
from __future__ import annotations

import pathlib
import shutil
from typing import Sequence

import torch
from safetensors.torch import save_file

from services.common.sglang_client import SGLangClient
from services.trainer.weight_sync.timing import PhaseTimer


def write_folder(named: Sequence[tuple[str, torch.Tensor]], config, folder: pathlib.Path,
                 timer: PhaseTimer) -> None:
    """Write `named` tensors and the config into `folder` (atomically: tmp + rename)."""
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with timer.phase("copy"):
        cpu = {n: t.detach().to("cpu").contiguous() for n, t in named}
    with timer.phase("serialise"):
        save_file(cpu, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.to_json_file(str(tmp / "config.json"))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


async def push_disk(named: Sequence[tuple[str, torch.Tensor]], clients: Sequence[SGLangClient], *,
                    config, root: pathlib.Path, weight_version: str, flush_cache: bool,
                    timer: PhaseTimer) -> None:
    """Write the weights under `root` and have every engine load them."""
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"weights-{weight_version}"
    write_folder(named, config, folder, timer)
    with timer.phase("engine_load"):
        for c in clients:
            await c.update_weights_from_disk(str(folder), flush_cache=flush_cache,
                                             weight_version=weight_version)
    for old in root.glob("weights-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
