"""The engine behind the HTTP API: request validation, generation, weight updates, pause/abort.

Weight updates are atomic to requests the way SGLang makes them: every
generate request holds a shared lock for its whole life, an update takes the
lock exclusively (new requests wait behind it), so no request sees two weight
versions. While generation is paused the update applies at once, between
decode steps, as SGLang does for its in-place/retract pause modes.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pathlib
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import torch

from services.common import batch_invariant
from services.common.model_store import resolve_model
from services.engine import weights
from services.engine.model import ModelRunner, dtype_name, load_model
from services.engine.sampling import SamplingParams, parse_sampling_params
from services.engine.scheduler import Scheduler, Sequence, new_rid

log = logging.getLogger(__name__)
VERSION = "rlyard-engine 0.1.0"


class BadRequest(ValueError):
    """The request is invalid; the message is the reason sent back with HTTP 400."""


class NotReady(RuntimeError):
    """The engine is still loading."""


class _UpdateLock:
    """Many generate requests, or one weight update (writer preferred, so updates are not starved)."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    async def acquire_exclusive(self) -> None:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True

    async def release_exclusive(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        await self.acquire_exclusive()
        try:
            yield
        finally:
            await self.release_exclusive()


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    max_running_requests: int = 64
    context_length: int | None = None
    require_weight_update_session: bool = False
    weight_update_session_timeout_s: float = 600.0
    cuda_graph: bool = True
    cuda_graph_max_len: int = 2048
    fp32_lm_head: bool = False
    deterministic_inference: bool = False
    load_format: str = "auto"


class Engine:
    """Model + tokenizer + scheduler, with the async operations the HTTP layer calls."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, model_path: str,
                 require_weight_update_session: bool = False, session_timeout_s: float = 600.0) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.require_session = require_weight_update_session
        eos = set()
        for source in (getattr(runner.config, "eos_token_id", None),
                       getattr(getattr(runner.model, "generation_config", None), "eos_token_id", None),
                       getattr(tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(i for i in source if isinstance(i, int))
        self.eos_ids = eos
        self.scheduler = Scheduler(runner, eos, self.detokenize)
        self.lock = _UpdateLock()
        self.session_open = False
        self.session_holds_lock = False  # the open session keeps generation out until it ends
        self.session_timeout_s = session_timeout_s
        self._session_timer: asyncio.TimerHandle | None = None
        self.groups: dict[str, weights.UpdateGroup] = {}
        self.started = time.time()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def load(cls, cfg: EngineConfig) -> "Engine":
        from transformers import AutoTokenizer

        from services.engine.model import parse_dtype
        device = torch.device(cfg.device)
        dtype = parse_dtype(cfg.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
        path = resolve_model(cfg.model)
        model = load_model(path, device, dtype, cfg.load_format)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # weights-only folders still serve token ids (text fields stay empty)
            log.warning("no tokenizer in %s (%s): serving token ids only", path, exc)
            tokenizer = None
        runner = ModelRunner(model, max_slots=cfg.max_running_requests, context_len=cfg.context_length,
                             cuda_graph=cfg.cuda_graph and device.type == "cuda", graph_max_len=cfg.cuda_graph_max_len)
        runner.fp32_lm_head = cfg.fp32_lm_head
        if cfg.deterministic_inference:
            batch_invariant.check_head_dim(runner.head_dim)
            runner.batch_invariant = True
            if not batch_invariant.kernels_available(device) or dtype == torch.float32:
                log.warning("--enable-deterministic-inference on %s %s: the torch formulas run instead of the "
                            "batch-invariant kernels (those need CUDA, triton and a 16-bit dtype)", device,
                            dtype_name(dtype))
        return cls(runner, tokenizer, str(path), cfg.require_weight_update_session,
                   cfg.weight_update_session_timeout_s)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # ---- text -----------------------------------------------------------------------------
    def detokenize(self, ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    # ---- info ------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def model_info(self) -> dict:
        cfg = self.runner.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "dtype": dtype_name(self.runner.dtype), "device": str(self.runner.device),
                "architectures": list(getattr(cfg, "architectures", None) or [type(self.runner.model).__name__]),
                "context_length": self.runner.context_len, "vocab_size": self.runner.vocab_size,
                "has_image_understanding": False, "has_audio_understanding": False}

    def server_info(self) -> dict:
        s = self.scheduler
        return {"version": VERSION, "model_path": self.model_path, "dtype": dtype_name(self.runner.dtype),
                "device": str(self.runner.device), "context_length": self.runner.context_len,
                "max_running_requests": self.runner.max_slots, "weight_version": self.weight_version,
                "decode_mode": self.runner.decode_mode,
                # server args, flattened as SGLang's /get_server_info reports them
                "enable_deterministic_inference": self.runner.batch_invariant,
                "enable_fp32_lm_head": self.runner.fp32_lm_head,
                "paused": s.paused, "weight_update_session_open": self.session_open,
                "require_weight_update_session": self.require_session,
                "internal_states": [{"num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                                     "forward_steps": s.steps, "decode_steps": s.decode_steps,
                                     "prefill_passes": s.prefill_passes, "prefill_tokens": s.prefill_tokens,
                                     "generated_tokens": s.generated_tokens,
                                     "kv_cache_bytes": self.runner.cache_bytes(),
                                     "kv_cache_capacity_tokens": self.runner.capacity}],
                "uptime_s": round(time.time() - self.started, 1)}

    # ---- generation -----------------------------------------------------------------------
    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise BadRequest("give exactly one of input_ids or text")
        if text is not None:
            if self.tokenizer is None:
                raise BadRequest("this engine has no tokenizer: send input_ids")
            texts = [text] if isinstance(text, str) else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a non-empty list of strings")
            prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
            batched = not isinstance(text, str)
        else:
            if not isinstance(ids, list) or not ids:
                raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists)")
            batched = isinstance(ids[0], list)
            prompts = ids if batched else [ids]
        vocab = self.runner.vocab_size
        for i, p in enumerate(prompts):
            where = f"input_ids[{i}]" if batched else "input_ids"
            if not isinstance(p, list) or not p:
                raise BadRequest(f"{where} must be a non-empty list of token ids")
            for tok in p:
                if isinstance(tok, bool) or not isinstance(tok, int):
                    raise BadRequest(f"{where} holds a non-integer token id: {tok!r}")
                if not 0 <= tok < vocab:
                    raise BadRequest(f"{where} holds token id {tok} outside the vocabulary [0, {vocab})")
            if len(p) >= self.runner.context_len:
                raise BadRequest(f"The input ({len(p)} tokens) is longer than the model's context length "
                                 f"({self.runner.context_len} tokens).")
        return prompts, batched

    @staticmethod
    def _per_item(value: Any, count: int, name: str, kind: type | tuple) -> list:
        items = value if isinstance(value, list) else [value] * count
        if len(items) != count:
            raise BadRequest(f"{name} has {len(items)} entries for {count} prompts")
        for v in items:
            if (isinstance(v, bool) and kind is int) or not isinstance(v, kind):
                raise BadRequest(f"{name} has a value of the wrong type: {v!r}")
        return items

    def build_sequences(self, body: Any) -> tuple[list[list[Sequence]], bool]:
        """Validate a /generate body into sequences (per prompt, n of them); BadRequest on any error."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the rlyard engine")
        prompts, batched = self._prompts(body)
        n = len(prompts)
        raw_params = body.get("sampling_params") or {}
        param_dicts = self._per_item(raw_params, n, "sampling_params", dict)
        try:
            params = [parse_sampling_params(d, self.runner.vocab_size) for d in param_dicts]
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        want_lp = self._per_item(body.get("return_logprob", False), n, "return_logprob", bool)
        start = self._per_item(body.get("logprob_start_len", -1), n, "logprob_start_len", int)
        rid = body.get("rid")
        if rid is None:
            rids = [new_rid() for _ in range(n)]
        elif isinstance(rid, str) and n > 1:
            rids = [f"{rid}_{i}" for i in range(n)]
        else:
            rids = self._per_item(rid, n, "rid", str)
        groups = []
        for i, prompt in enumerate(prompts):
            if start[i] >= len(prompt):
                raise BadRequest(f"logprob_start_len {start[i]} must be smaller than the prompt ({len(prompt)} tokens)")
            k = params[i].n
            groups.append([Sequence(rid=rids[i] if k == 1 else f"{rids[i]}#{j}", prompt=list(prompt),
                                    params=params[i], return_logprob=want_lp[i], logprob_start_len=start[i])
                           for j in range(k)])
        return groups, batched or any(len(g) > 1 for g in groups)

    def reply(self, seq: Sequence) -> dict:
        """SGLang's /generate reply for one finished sequence."""
        p = seq.params
        ids = seq.output_ids
        reason = seq.finish or {"type": "abort", "message": "unfinished"}
        if p.no_stop_trim or reason.get("type") != "stop":
            text = self.detokenize(ids, p)
        elif isinstance(reason.get("matched"), int):
            text = self.detokenize(ids[:-1], p)
        else:
            text = self.detokenize(ids, p)[: seq.finished_len]
        meta: dict[str, Any] = {
            "id": seq.rid, "finish_reason": reason, "prompt_tokens": len(seq.prompt),
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": seq.weight_version or self.weight_version,
            "e2e_latency": round(time.monotonic() - seq.created, 6)}
        if seq.return_logprob:
            start = len(seq.prompt) if seq.logprob_start_len < 0 else seq.logprob_start_len
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.input_logprobs or [], seq.prompt[start:])]
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs, ids)]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    async def generate(self, body: Any) -> dict | list[dict]:
        groups, as_list = self.build_sequences(body)
        seqs = [s for g in groups for s in g]
        async with self.lock.shared():
            self.scheduler.submit(seqs)
            try:
                await asyncio.gather(*(asyncio.wrap_future(s.future) for s in seqs))
            except asyncio.CancelledError:  # client went away: free its slots
                self.scheduler.call(lambda: [self.scheduler.abort(rid=s.rid) for s in seqs])
                raise
            for s in seqs:  # version seen by the request (constant unless updated while paused)
                s.weight_version = self.weight_version
        replies = [self.reply(s) for s in seqs]
        return replies if as_list else replies[0]

    async def run_in_scheduler(self, fn) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- weight updates -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _update_slot(self, abort_all: bool = False) -> AsyncIterator[None]:
        if abort_all:
            await self.run_in_scheduler(lambda: self.scheduler.abort(abort_all=True, message="Abort for weight update"))
        if self.scheduler.paused or self.session_holds_lock:
            # Paused: SGLang applies updates at once (between steps, in the scheduler thread).
            # In a session: the session already holds generation off.
            yield
        else:
            async with self.lock.exclusive():
                yield

    def _check_session(self, what: str) -> None:
        if self.require_session and not self.session_open:
            raise BadRequest(f"{what} must run between begin_weight_update() and end_weight_update()")

    async def _load(self, named: weights.NamedTensors, version: Any, flush: bool,
                    ipc_events: list | None = None) -> str:
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string")

        def load() -> int:
            pairs = weights.check(self.runner, named)
            count = weights.apply(pairs, ipc_events)
            if version is not None:
                self.scheduler.weight_version = version
            if flush:
                self.scheduler.flush_cache()  # no-op while paused requests keep their KV
            return count
        try:
            count = await self.run_in_scheduler(load)
        except weights.WeightUpdateError as exc:
            raise BadRequest(str(exc)) from exc
        return f"Succeeded to update {count} tensors; weight_version={self.weight_version}"

    async def update_weights_from_tensor(self, body: Any) -> str:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        self._check_session("update_weights_from_tensor")
        t0, reused = time.perf_counter(), weights.IPC_MAPPINGS.reused
        serialized, events = body.get("serialized_named_tensors"), []
        try:
            if isinstance(serialized, list) and sum(len(s) for s in serialized if isinstance(s, (str, bytes))) < 1 << 20:
                # handles and metadata only: decoding takes about a millisecond, less than a thread hop costs
                named = weights.decode_tensor_payload(serialized, body.get("load_format"), events)
            else:  # tensors pickled by value: keep the event loop free while they are rebuilt
                named = await asyncio.to_thread(weights.decode_tensor_payload, serialized,
                                                body.get("load_format"), events)
        except weights.WeightUpdateError as exc:
            raise BadRequest(str(exc)) from exc
        t1 = time.perf_counter()
        try:
            async with self._update_slot(bool(body.get("abort_all_requests"))):
                t2 = time.perf_counter()
                message = await self._load(named, body.get("weight_version"),
                                           body.get("flush_cache", True) is not False, events)
            log.info("update_weights_from_tensor: %d tensors; decode %.2f ms (%s), wait %.2f ms, load %.2f ms",
                     len(named), (t1 - t0) * 1e3,
                     "held buffer" if weights.IPC_MAPPINGS.reused > reused else "new buffer",
                     (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3)
            return message
        finally:
            del named  # drop this request's views; IPC mappings stay only in weights.IPC_MAPPINGS

    async def update_weights_from_disk(self, body: Any) -> str:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path (string) is required")
        try:
            path = resolve_model(body["model_path"])
        except Exception as exc:
            raise BadRequest(str(exc)) from exc
        self._check_compatible(path)
        try:
            named = await asyncio.to_thread(weights.read_checkpoint, pathlib.Path(path))
        except weights.WeightUpdateError as exc:
            raise BadRequest(str(exc)) from exc
        async with self._update_slot(bool(body.get("abort_all_requests"))):
            message = await self._load(named, body.get("weight_version"), body.get("flush_cache", True) is not False)
        self.model_path = str(path)
        return message

    def _check_compatible(self, path: pathlib.Path) -> None:
        import json
        cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
        mine = self.runner.config
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
            if key in cfg and cfg[key] != getattr(mine, key, None):
                raise BadRequest(f"{path}: {key}={cfg[key]} differs from the served model's {getattr(mine, key, None)}")

    async def init_weights_update_group(self, body: Any) -> str:
        from services.common.weight_wire import join_weight_update_group
        try:
            addr, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest("master_address, master_port, rank_offset and world_size are required") from exc
        name = body.get("group_name") or "weight_update_group"
        backend = body.get("backend") or "nccl"
        on_gpu = self.runner.device.type == "cuda"
        if backend == "nccl" and not on_gpu:
            raise BadRequest("backend nccl needs the engine on a GPU; this engine runs on CPU: use backend gloo")
        if backend not in ("nccl", "gloo"):
            raise BadRequest(f"unsupported backend {backend!r}: use nccl or gloo")
        if name in self.groups:
            raise BadRequest(f"group {name} already exists; destroy it first")
        if not 0 < rank < world:
            raise BadRequest("rank_offset must be in [1, world_size): rank 0 is the trainer")
        if on_gpu:
            torch.cuda.set_device(self.runner.device)
        try:
            pg = await asyncio.to_thread(join_weight_update_group, addr, port, rank, world, name, backend)
        except Exception as exc:
            raise BadRequest(f"could not join group {name}: {exc}") from exc
        device = self.runner.device if backend == "nccl" else torch.device("cpu")
        self.groups[name] = weights.UpdateGroup(pg, device)
        return "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(self, body: Any) -> str:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        name = body.get("group_name") or "weight_update_group"
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"group {name} not initialised: call init_weights_update_group first")
        self._check_session("update_weights_from_distributed")
        async with self._update_slot(bool(body.get("abort_all_requests"))):
            try:
                named = await asyncio.to_thread(group.receive, body.get("names") or [], body.get("dtypes") or [],
                                                body.get("shapes") or [], body.get("load_format"))
            except weights.WeightUpdateError as exc:
                raise BadRequest(str(exc)) from exc
            return await self._load(named, body.get("weight_version"), body.get("flush_cache", True) is not False)

    async def destroy_weights_update_group(self, body: Any) -> str:
        name = (body or {}).get("group_name") or "weight_update_group"
        group = self.groups.pop(name, None)
        if group is None:
            raise BadRequest(f"group {name} does not exist")
        await asyncio.to_thread(group.destroy)
        return "Succeeded to destroy custom process group."

    async def begin_weight_update(self, caller_gone: Callable[[], Awaitable[bool]] | None = None) -> str:
        """Open a session: wait for running requests, then hold new ones until end_weight_update,
        so an update sent in several buckets is still atomic to every request.

        `caller_gone` is asked once the wait is over: a caller that gave up (timed out) meanwhile
        would never send end_weight_update, so the session is not opened for it.
        """
        if self.session_open:
            raise BadRequest("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        if not self.scheduler.paused:
            await self.lock.acquire_exclusive()
            self.session_holds_lock = True
        if caller_gone is not None and await caller_gone():
            await self._close_session()
            raise BadRequest("caller disconnected while the session waited for running requests")
        self._session_timer = asyncio.get_running_loop().call_later(
            self.session_timeout_s, lambda: asyncio.ensure_future(self._expire_session()))
        return "Success"

    async def end_weight_update(self) -> str:
        if not self.session_open:
            raise BadRequest("no weight-update session is open; call begin_weight_update() first")
        await self._close_session()
        return "Success"

    async def _close_session(self) -> None:
        if self._session_timer is not None:
            self._session_timer.cancel()
            self._session_timer = None
        self.session_open = False
        if self.session_holds_lock:
            self.session_holds_lock = False
            await self.lock.release_exclusive()

    async def _expire_session(self) -> None:
        if self.session_open:
            log.warning("weight-update session open for %.0fs without end_weight_update: closing it",
                        self.session_timeout_s)
            await self._close_session()

    # ---- scheduling control ----------------------------------------------------------------
    async def flush_cache(self) -> bool:
        return await self.run_in_scheduler(self.scheduler.flush_cache)

    async def pause(self, mode: Any) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        await self.run_in_scheduler(lambda: self.scheduler.pause(mode))

    async def resume(self) -> None:
        await self.run_in_scheduler(self.scheduler.resume)

    async def abort(self, rid: Any, abort_all: bool) -> int:
        if not abort_all and (not isinstance(rid, str) or not rid):
            raise BadRequest("give rid (string) or abort_all=true")
        return await self.run_in_scheduler(lambda: self.scheduler.abort(rid=rid, abort_all=abort_all))

    async def health_generate(self, timeout: float = 30.0) -> bool:
        if self.scheduler.paused:
            return True
        seq = Sequence(rid=f"health-{new_rid()}", prompt=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0))
        self.scheduler.submit([seq])
        try:
            await asyncio.wait_for(asyncio.wrap_future(seq.future), timeout)
        except asyncio.TimeoutError:
            await self.run_in_scheduler(lambda: self.scheduler.abort(rid=seq.rid))
            return False
        return seq.finish is not None and seq.finish.get("type") != "abort"
