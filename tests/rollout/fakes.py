"""Test-only stand-ins for the engine, the sandbox and the trainer.

They follow the real contracts (SGLang /generate reply shape, the Sandbox and
Trainer gRPC services) closely enough to drive the orchestrator's own logic;
the real services are exercised by tests/integration.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

import grpc
import numpy as np
from fastapi import FastAPI, Request

from services.common.packing import unpack
from services.common.proto.rlyard.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.rollout.sandbox_client import CommandResult
from services.rollout.tasks import Task


# ---- engine ---------------------------------------------------------------------------------
class FakeEngine:
    """Generates `policy(context_text)` as real tokenizer ids, with SGLang's stop semantics."""

    def __init__(self, tokenizer: Any, policy: Callable[[str], str], logprob: float = -0.25) -> None:
        self.tok = tokenizer
        self.policy = policy
        self.logprob = logprob
        self.calls: list[dict[str, Any]] = []
        self.replies: list[dict[str, Any]] = []
        self.weight_version = "0"
        self.paused = 0
        self.abort_next = 0
        self.delay_s = 0.0

    async def generate(self, input_ids: list[int], sampling_params: dict, *, return_logprob: bool = False,
                       rid: Optional[str] = None, logprob_start_len: int = -1) -> dict:
        self.calls.append({"input_ids": list(input_ids), "sampling_params": dict(sampling_params)})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self.policy(self.tok.decode(input_ids, skip_special_tokens=False))
        # A policy returns text (tokenized canonically) or the exact ids a model sampled.
        ids = list(reply) if isinstance(reply, list) else list(self.tok.encode(reply, add_special_tokens=False))
        eos = sampling_params.get("stop_token_ids") or [self.tok.eos_token_id]
        stops = sampling_params.get("stop") or []
        out: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": sampling_params["max_new_tokens"]}
        for tid in ids + [eos[0]]:
            if len(out) >= sampling_params["max_new_tokens"]:
                break
            out.append(tid)
            if tid in eos:
                finish = {"type": "stop", "matched": tid}
                break
            decoded = self.tok.decode(out, skip_special_tokens=False)
            hit = next((s for s in stops if s in decoded), None)
            if hit:
                finish = {"type": "stop", "matched": hit}
                break
        if self.abort_next:
            self.abort_next -= 1
            finish = {"type": "abort", "message": "aborted by pause_generation"}
        meta = {"id": rid or uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(input_ids),
                "completion_tokens": len(out), "weight_version": self.weight_version}
        if return_logprob:
            meta["output_token_logprobs"] = [[self.logprob, t, None] for t in out]
        text = self.tok.decode(out, skip_special_tokens=True)
        if isinstance(finish.get("matched"), str):  # like SGLang: text is trimmed at the stop string
            text = text[:text.find(finish["matched"])]
        result = {"text": text, "output_ids": out, "meta_info": meta}
        self.replies.append(result)
        return result


def solution_policy(tasks: list[Task], wrong_rate: float = 0.0, seed: int = 0) -> Callable[[str], str]:
    """A policy that plays each task's known solution, answering wrong with probability `wrong_rate`."""
    by_instruction = {t.instruction: t for t in tasks}
    rng = random.Random(seed)

    def policy(context: str) -> str:
        last = context.rsplit("Task: ", 1)[-1]
        instruction = last.split("<|im_end|>", 1)[0]
        task = by_instruction.get(instruction)
        if task is None or task.solution is None:
            return "I am not sure."
        if "<tool_response>" not in last:
            return f"<bash>{'; '.join(task.solution.commands)}</bash>"
        output = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last, re.DOTALL)[-1]
        answer = task.solution.answer if task.solution.answer is not None else output.strip().splitlines()[-1]
        if rng.random() < wrong_rate:
            answer = "wrong"
        return f"<answer>{answer}</answer>"

    return policy


# ---- sandbox --------------------------------------------------------------------------------
class LocalSandbox:
    """Runs bash in a private temporary home directory (no isolation: tests only)."""

    def __init__(self, root: Optional[str] = None) -> None:
        self.home = root or tempfile.mkdtemp(prefix="rlyard-test-sb-")
        self.commands: list[str] = []

    async def run(self, command: str, timeout_s: float, max_output_bytes: int = 0) -> CommandResult:
        self.commands.append(command)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.home, "LANG": "C.UTF-8"}
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("/bin/bash", "-c", command, cwd=self.home, env=env,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
            code, timed_out = proc.returncode, False
        except asyncio.TimeoutError:
            os.killpg(proc.pid, 9)
            out, err = await proc.communicate()
            code, timed_out = 124, True
        cap = max_output_bytes or 65536
        return CommandResult(code, out[:cap].decode(errors="replace"), err[:cap].decode(errors="replace"),
                             timed_out, len(out) > cap or len(err) > cap, (time.perf_counter() - t0) * 1000)

    async def write_file(self, path: str, data: bytes, mode: int = 0) -> None:
        full = os.path.join(self.home, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
        os.chmod(full, mode or 0o644)

    def close(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


class FakeSandboxService(sandbox_pb2_grpc.SandboxServicer):
    """The Sandbox gRPC service over LocalSandbox folders."""

    def __init__(self, fork: bool = True, fail_exec_every: int = 0) -> None:
        self.boxes: dict[str, LocalSandbox] = {}
        self.fork = fork
        self.created = self.forked = self.killed = self.execs = 0
        self.fail_exec_every = fail_exec_every

    async def _box(self, sid: str, context: grpc.aio.ServicerContext) -> LocalSandbox:
        if sid not in self.boxes:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {sid} not found")
        return self.boxes[sid]

    async def Create(self, request, context):
        sid = "sb-" + uuid.uuid4().hex[:8]
        self.boxes[sid] = LocalSandbox()
        self.created += 1
        return sandbox_pb2.SandboxInfo(sandbox_id=sid, state=sandbox_pb2.SANDBOX_STATE_RUNNING)

    async def Fork(self, request, context):
        if not self.fork:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fork is not supported by this backend")
        parent = await self._box(request.sandbox_id, context)
        children = []
        for _ in range(request.count):
            sid = "sb-" + uuid.uuid4().hex[:8]
            child = LocalSandbox()
            shutil.copytree(parent.home, child.home, dirs_exist_ok=True, symlinks=True)
            self.boxes[sid] = child
            children.append(sandbox_pb2.SandboxInfo(sandbox_id=sid, parent_id=request.sandbox_id))
        self.forked += request.count
        return sandbox_pb2.ForkResponse(children=children, kind="filesystem")

    async def Exec(self, request, context):
        box = await self._box(request.sandbox_id, context)
        self.execs += 1
        if self.fail_exec_every and self.execs % self.fail_exec_every == 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sandbox worker crashed (injected)")
        r = await box.run(request.shell, request.timeout_s or 30, request.max_output_bytes)
        return sandbox_pb2.ExecResult(exit_code=r.exit_code, stdout=r.stdout.encode(), stderr=r.stderr.encode(),
                                      timed_out=r.timed_out, duration_ms=r.duration_ms)

    async def WriteFile(self, request, context):
        box = await self._box(request.sandbox_id, context)
        await box.write_file(request.path, request.data, request.mode)
        return sandbox_pb2.FileInfo(name=os.path.basename(request.path), path=request.path, type="file")

    async def Kill(self, request, context):
        box = self.boxes.pop(request.sandbox_id, None)
        if box is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"sandbox {request.sandbox_id} not found")
        box.close()
        self.killed += 1
        return common_pb2.Empty()


# ---- trainer --------------------------------------------------------------------------------
class FakeTrainerService(trainer_pb2_grpc.TrainerServicer):
    """Checks each batch like the real trainer would and counts versions; no model."""

    def __init__(self, engine: Optional[FakeEngine] = None, train_delay_s: float = 0.0) -> None:
        self.engine = engine
        self.version = 0
        self.batches: list[list[trainer_pb2.Episode]] = []
        self.headers: list[trainer_pb2.StepHeader] = []
        self.syncs: list[trainer_pb2.SyncWeightsRequest] = []
        self.train_delay_s = train_delay_s
        self.checkpoints = 0

    async def TrainStep(self, request_iterator, context):
        header, eps = None, []
        async for chunk in request_iterator:
            if chunk.WhichOneof("chunk") == "header":
                header = chunk.header
            else:
                eps.append(chunk.episode)
        if header is None or header.num_episodes != len(eps):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "header missing or episode count wrong")
        for ep in eps:
            n = len(unpack(ep.response_ids, "int32"))
            if not (n == len(unpack(ep.loss_mask, "int32")) == len(unpack(ep.rollout_logprobs, "float32"))):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "per-token arrays differ in length")
        if self.train_delay_s:
            await asyncio.sleep(self.train_delay_s)
        self.headers.append(header)
        self.batches.append(eps)
        self.version += 1
        tokens = sum(int(np.sum(unpack(e.loss_mask, "int32"))) for e in eps)
        return trainer_pb2.TrainStepResult(step=self.version, policy_version=self.version,
                                           metrics={"loss": 0.1, "tokens": float(tokens),
                                                    "logprob_diff_mean": 0.01})

    async def SyncWeights(self, request, context):
        self.syncs.append(request)
        if self.engine is not None:
            self.engine.weight_version = request.weight_version or str(self.version)
        return trainer_pb2.SyncWeightsResult(weight_version=request.weight_version, bytes=1, buckets=1,
                                             method=request.method or "ipc")

    async def SaveCheckpoint(self, request, context):
        self.checkpoints += 1
        return trainer_pb2.CheckpointInfo(path=request.path or f"/tmp/ckpt/step-{self.version}",
                                          step=self.version, policy_version=self.version)

    async def LoadCheckpoint(self, request, context):
        self.version = 7
        return trainer_pb2.CheckpointInfo(path="/tmp/ckpt/step-7", step=7, policy_version=7)

    async def GetStatus(self, request, context):
        return trainer_pb2.TrainerStatus(model="fake", device="cpu", step=self.version,
                                         policy_version=self.version)


def engine_app(engine: FakeEngine):
    """FakeEngine behind the SGLang HTTP routes the orchestrator calls."""
    app = FastAPI()

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> dict:
        return {}

    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": "fake", "weight_version": engine.weight_version}

    @app.post("/generate")
    async def generate(request: Request) -> dict:
        body = await request.json()
        return await engine.generate(body["input_ids"], body["sampling_params"],
                                     return_logprob=body.get("return_logprob", False), rid=body.get("rid"))

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict:
        engine.paused += 1
        return {"success": True}

    @app.post("/continue_generation")
    async def cont() -> dict:
        return {"success": True}

    return app
