"""One real engine process (SmolLM2-135M on CPU, 0.5.23-style strict weight-update sessions) per test session."""
import os
import pathlib
import subprocess
import sys
import time

import httpx
import pytest
import torch

from services.common.net import free_port as _free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny_llama(vocab_size: int = 64, layers: int = 2, max_positions: int = 64, seed: int = 0):
    """A seeded random Llama (hidden 32, 4 heads over 2 KV heads) small enough for CPU unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def engine_url(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}  # robust on a shared 2-core box
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--port", str(port),
                                 "--max-running-requests", "16", "--require-weight-update-session"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine not ready: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def hf_model():
    """The same model loaded with plain transformers, as the reference for numerics."""
    from transformers import AutoModelForCausalLM

    from services.common.model_store import resolve_model
    return AutoModelForCausalLM.from_pretrained(str(resolve_model()), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def checkpoint():
    """The served model's weights as saved on disk (the restore point of the weight-update tests)."""
    from safetensors.torch import load_file

    from services.common.model_store import resolve_model
    return load_file(str(resolve_model() / "model.safetensors"))


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from services.common.model_store import resolve_model
    return AutoTokenizer.from_pretrained(str(resolve_model()))


@pytest.fixture(scope="session")
def prompt(tokenizer):
    return tokenizer.encode("The capital of France is")


@pytest.fixture
async def client(engine_url):
    from services.common.sglang_client import SGLangClient
    async with SGLangClient(engine_url, timeout=120) as c:
        yield c
