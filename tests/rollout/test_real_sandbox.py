"""Every task's verifier against the real sandbox-executor (started here as its own process)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from services.common.grpc_server import check_health
from services.common.model_store import cache_dir
from services.rollout.sandbox_client import SandboxClient, SandboxError
from services.rollout.tasks import load_split
from services.rollout.verify import prepare
from tests.rollout.conftest import free_port
from tests.rollout.solutions import replay


@pytest.fixture(scope="module")
def sandbox_addr(tmp_path_factory):
    if os.environ.get("RLYARD_TEST_SANDBOX_ADDR"):
        yield os.environ["RLYARD_TEST_SANDBOX_ADDR"]
        return
    port = free_port()
    tmp = tmp_path_factory.mktemp("sandbox")
    # A private state directory (one sandbox service per directory) sharing the built templates.
    templates = cache_dir() / "templates"
    if not (templates / "default").exists():
        pytest.skip(f"no sandbox template in {templates}: python -m services.sandbox template build default")
    (tmp / "home").mkdir()
    (tmp / "home" / "templates").symlink_to(templates)
    log = open(tmp / "sandbox.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.sandbox", "--grpc-port", str(port),
                             "--http-port", str(free_port()), "--host", "127.0.0.1", "--home", str(tmp / "home")],
                            stdout=log, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not asyncio.run(check_health(addr)):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"the sandbox service did not start (see {log.name})")
            time.sleep(0.5)
        yield addr
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def _solve(client: SandboxClient, task, good: bool):
    sb = await client.create("", 120, {"test": task.id})
    try:
        return await replay(task, sb, good)
    finally:
        await sb.kill()


async def test_every_verifier_in_the_real_sandbox(sandbox_addr):
    tasks = load_split("train") + load_split("eval")
    async with SandboxClient(sandbox_addr) as client:
        try:
            await (await client.create("", 30)).kill()
        except SandboxError as exc:
            pytest.skip(f"the sandbox cannot create sandboxes here: {exc}")
        good = await asyncio.gather(*(_solve(client, t, True) for t in tasks))
        bad = await asyncio.gather(*(_solve(client, t, False) for t in tasks))
    for task, ok, ko in zip(tasks, good, bad):
        assert ok.passed, f"{task.id}: solution rejected in the real sandbox: {ok.notes}"
        assert not ko.passed, f"{task.id}: passes without a solution"


async def test_fork_carries_the_setup(sandbox_addr):
    task = next(t for t in load_split("train") if t.id == "grep_error_lines")
    async with SandboxClient(sandbox_addr) as client:
        parent = await client.create("", 60)
        try:
            await prepare(task, parent)
            try:
                children = await client.fork(parent, 2)
            except SandboxError as exc:
                pytest.skip(f"fork unsupported: {exc}")
        finally:
            await parent.kill()
        try:
            for child in children:
                r = await child.run("grep -c ERROR app.log", 10)
                assert r.stdout.strip() == "3"
        finally:
            for child in children:
                await child.kill()
