"""One RL run: sample tasks, play groups, score, train, sync weights, evaluate, record.

`sync` mode: generate -> train -> sync weights -> repeat.
`async` mode: a producer keeps playing groups on the engine's current
weights while the trainer trains, at most `staleness_k` steps ahead; episodes
more than `staleness_k` policy versions old (possible when generation is the
slower side) are dropped or down-weighted; weights land between engine steps
inside pause_generation / continue_generation.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from services.common.grpc_server import check_health
from services.common.model_store import resolve_model
from services.common.sglang_client import EngineError, SGLangClient
from services.rollout import advantages
from services.rollout.config import RunConfig
from services.rollout.episode import Episode, EpisodeRunner
from services.rollout.groups import GroupPlayer
from services.rollout.metrics import PromMetrics, TensorBoardWriter, episode_metrics, scalar_items
from services.rollout.prompt import PromptBuilder
from services.rollout.sandbox_client import SandboxClient
from services.rollout.store import RunDir, RunInfo
from services.rollout.tasks import Task, TaskError, select
from services.rollout.trainer_client import TrainerClient, TrainerError

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]
_TOKENIZERS: dict[str, Any] = {}


class StepFailed(RuntimeError):
    """A step could not produce a batch; the message says why."""


@dataclass
class Collected:
    """What a step's generation produced."""
    groups: list[list[Episode]]   # kept groups, advantages set: the training batch
    played: list[Episode]         # every episode that played to the end (kept or not)
    failed: list[Episode]         # episodes that could not be played, with their reason
    dropped: int                  # groups dropped for zero reward variance
    gen_s: float                  # wall time of the generation phase


@dataclass
class Endpoints:
    engine_url: str = "http://127.0.0.1:30000"
    trainer_addr: str = "127.0.0.1:50052"
    sandbox_addr: str = "127.0.0.1:50051"

    def for_run(self, cfg: RunConfig) -> "Endpoints":
        return Endpoints(cfg.engine_url or self.engine_url, cfg.trainer_addr or self.trainer_addr,
                         cfg.sandbox_addr or self.sandbox_addr)


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer (cached per folder); raises ModelNotFound with a hint."""
    path = str(resolve_model(model))
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


class TaskSampler:
    """Cycles through shuffled tasks so every task is seen equally often."""

    def __init__(self, tasks: list[Task], seed: int) -> None:
        self.tasks = tasks
        self.rng = random.Random(seed)
        self._queue: list[Task] = []

    def next(self) -> Task:
        if not self._queue:
            self._queue = list(self.tasks)
            self.rng.shuffle(self._queue)
        return self._queue.pop()


class RunLoop:
    """Executes one run to its end; every outcome lands in `info` and on disk."""

    def __init__(self, cfg: RunConfig, rd: RunDir, info: RunInfo, endpoints: Endpoints, emit: Emit,
                 prom: PromMetrics, stop: asyncio.Event) -> None:
        self.cfg = cfg
        self.rd = rd
        self.info = info
        self.ep = endpoints.for_run(cfg)
        self.emit = emit
        self.prom = prom
        self.stop = stop
        self.version = 0
        self.tb: Optional[TensorBoardWriter] = None
        self.engine: Optional[SGLangClient] = None
        self.trainer: Optional[TrainerClient] = None
        self.sandbox: Optional[SandboxClient] = None
        self._can_pause = True

    # ---- state ----------------------------------------------------------------------------
    def _set_state(self, state: str, message: str = "") -> None:
        self.info.state = state  # type: ignore[assignment]
        if message:
            self.info.message = message
        now = time.time()
        if state == "running" and not self.info.started_at:
            self.info.started_at = now
        if state in ("succeeded", "failed", "stopped"):
            self.info.ended_at = now
        self.rd.write_info(self.info)
        self.emit({"type": "state", "run": self.info.model_dump()})

    def _log(self, message: str) -> None:
        log.info("run %s: %s", self.info.run_id, message)
        self.emit({"type": "log", "message": message})

    # ---- entry ----------------------------------------------------------------------------
    async def execute(self) -> None:
        self._set_state("running")
        state, message = "succeeded", ""
        try:
            await self._connect()
            await self._main()
        except asyncio.CancelledError:
            state, message = "stopped", "cancelled (orchestrator shutting down)"
            raise
        except (StepFailed, TrainerError, EngineError, TaskError) as exc:
            state, message = "failed", str(exc)
        except Exception as exc:
            log.exception("run %s crashed", self.info.run_id)
            state, message = "failed", f"{type(exc).__name__}: {exc}"
        else:
            if self.stop.is_set() and self.info.step < self.cfg.steps:
                state, message = "stopped", f"stopped by request after step {self.info.step}"
            else:
                message = f"{self.info.step} steps done"
        finally:
            await self._close()
            # The report is on disk before the final state is announced.
            self.info.state, self.info.message = state, message  # type: ignore[assignment]
            try:
                from services.rollout.report import write_report
                self.rd.write_info(self.info)
                await asyncio.to_thread(write_report, self.rd)
            except Exception as exc:  # a report problem must not change the run's outcome
                log.warning("report of %s failed: %s", self.info.run_id, exc)
            self._set_state(state, message)

    async def _connect(self) -> None:
        cfg = self.cfg
        self.train_tasks = select(cfg.split, cfg.tasks)
        self.eval_tasks = select(cfg.eval.split, cfg.eval.tasks) if cfg.eval.every else []
        if cfg.eval.limit:
            self.eval_tasks = self.eval_tasks[:cfg.eval.limit]
        tok = await asyncio.to_thread(load_tokenizer, cfg.model)
        self.prompts = PromptBuilder(tok, cfg.prompt.system_prompt, cfg.prompt.examples)
        self.tb = TensorBoardWriter(self.rd.path / "tb")
        self._log(f"connecting: engine {self.ep.engine_url}, trainer {self.ep.trainer_addr}, "
                  f"sandbox {self.ep.sandbox_addr}")
        for name, addr in (("trainer", self.ep.trainer_addr), ("sandbox", self.ep.sandbox_addr)):
            if not await _wait_health(addr, cfg.startup_timeout_s, self.stop):
                raise StepFailed(f"{name} at {addr} is not serving (gRPC health check failed for "
                                 f"{cfg.startup_timeout_s:g} s)")
        self.engine = SGLangClient(self.ep.engine_url, timeout=cfg.episode.engine_timeout_s)
        await self.engine.wait_ready(timeout=cfg.startup_timeout_s)
        self.trainer = TrainerClient(self.ep.trainer_addr)
        self.sandbox = SandboxClient(self.ep.sandbox_addr)
        status = await self.trainer.status()
        self.version = int(status.policy_version)
        if cfg.resume:
            ck = await self.trainer.load_checkpoint("")
            self.version = int(ck.policy_version)
            self._log(f"resumed from checkpoint {ck.path} (policy version {self.version})")
        # The engine may hold other weights (a previous run, a restarted trainer): start on-policy.
        await self._sync_weights()
        self.info.policy_version = self.version
        self.runner = EpisodeRunner(self.engine, self.prompts, cfg.episode, version_hint=lambda: self.version)
        self.limit = asyncio.Semaphore(cfg.concurrency)
        self.player = GroupPlayer(cfg, self.runner, self.sandbox, self.limit)
        self.sampler = TaskSampler(self.train_tasks, cfg.seed)

    async def _close(self) -> None:
        for closer in (self.engine and self.engine.aclose, self.trainer and self.trainer.close,
                       self.sandbox and self.sandbox.close, self.tb and self.tb.close):
            if closer:
                try:
                    res = closer()
                    if asyncio.iscoroutine(res):
                        await res
                except Exception as exc:
                    log.debug("close: %s", exc)

    async def _main(self) -> None:
        cfg = self.cfg
        if self.eval_tasks and cfg.eval.at_start:
            await self._evaluate(0)
        if cfg.mode == "sync":
            await self._run_sync()
        else:
            await self._run_async()
        if self.eval_tasks and self.info.step and self.info.step % cfg.eval.every:
            await self._evaluate(self.info.step)  # the end of the curve
        if self.info.step:
            await self._checkpoint()

    # ---- sync mode --------------------------------------------------------------------------
    async def _run_sync(self) -> None:
        for step in range(1, self.cfg.steps + 1):
            if self.stop.is_set():
                return
            t0 = time.perf_counter()
            for attempt in range(self.cfg.step_retries + 1):
                try:
                    got = await self._collect(step, self._play_fresh_groups)
                    break
                except StepFailed as exc:
                    if attempt == self.cfg.step_retries or self.stop.is_set():
                        raise
                    self._log(f"{exc}; replaying the step ({attempt + 1}/{self.cfg.step_retries})")
                    await asyncio.sleep(2.0)
            await self._train_and_sync(step, got, t0, staleness=[0])

    async def _play_fresh_groups(self, step: int, count: int) -> list[list[Episode]]:
        tasks = [self.sampler.next() for _ in range(count)]
        progress = self._progress = _Progress(self, step, count * self.cfg.group_size)
        return list(await asyncio.gather(*(
            self.player.play_group(t, self.cfg.group_size, on_episode=progress.tick) for t in tasks)))

    async def _collect(self, step: int, play: Callable[[int, int], Any]) -> "Collected":
        """Groups for one step: played, failures removed, advantages set, zero-variance handled."""
        cfg = self.cfg
        t0 = time.perf_counter()
        kept_groups: list[list[Episode]] = []
        played_ok: list[Episode] = []
        failed: list[Episode] = []
        played_total = 0
        dropped = 0
        rounds = 0
        need = cfg.prompts_per_step
        while True:
            raw = await play(step, need)
            for group in raw:
                played_total += len(group)
                failed += [e for e in group if e.failed]
                ok = [e for e in group if not e.failed]
                played_ok += ok
                kept, n_drop = advantages.assign([ok], cfg.advantage.eps, cfg.advantage.drop_zero_variance)
                dropped += n_drop
                if kept:
                    kept_groups.append(kept)
            need = cfg.prompts_per_step - len(kept_groups)
            if need <= 0 or not (cfg.advantage.dynamic_sampling and cfg.advantage.drop_zero_variance) \
                    or rounds >= cfg.advantage.max_extra_rounds or self.stop.is_set():
                break
            rounds += 1
        self._record_failures(step, failed)
        ok_count = played_total - len(failed)
        if ok_count < cfg.min_ok_fraction * played_total or ok_count == 0:
            raise StepFailed(f"step {step}: only {ok_count} of {played_total} episodes succeeded "
                             f"(min_ok_fraction {cfg.min_ok_fraction}): {_failure_summary(failed)}")
        return Collected(kept_groups, played_ok, failed, dropped, time.perf_counter() - t0)

    def _record_failures(self, step: int, failed: list[Episode]) -> None:
        for e in failed:
            self.rd.append("failures.jsonl", {"step": step, "task_id": e.task_id, "reason": e.failed,
                                              "error": e.error})

    async def _train_and_sync(self, step: int, got: "Collected", t0: float, staleness: list[int],
                              stale_dropped: int = 0) -> None:
        cfg = self.cfg
        batch = [e for g in got.groups for e in g]
        played, failed, dropped, gen_s = got.played, got.failed, got.dropped, got.gen_s
        train_metrics: dict[str, float] = {}
        train_s = sync_s = 0.0
        if batch:
            _Progress(self, step, len(batch), "train")
            t1 = time.perf_counter()
            result = await self.trainer.train_step(batch, cfg.loss, cfg.sampling.temperature,
                                                   step_id=f"{self.info.run_id}/step-{step}")
            train_s = time.perf_counter() - t1
            self.version = int(result.policy_version)
            train_metrics = {f"train/{k}": float(v) for k, v in result.metrics.items()}
            _Progress(self, step, 1, "sync")
            t2 = time.perf_counter()
            await self._sync_weights()
            sync_s = time.perf_counter() - t2
        m = episode_metrics(played, failed)
        m.update(train_metrics)
        m["tokens_trained"] = float(sum(len(e.prompt_ids) + len(e.response_ids) for e in batch))
        m["loss_tokens"] = float(sum(e.generated_tokens for e in batch))
        m["episodes_trained"] = float(len(batch))
        m["groups_dropped_zero_variance"] = float(dropped)
        m["episodes_dropped_stale"] = float(stale_dropped)
        m["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
        m["staleness_max"] = float(max(staleness) if staleness else 0)
        m["logprob_mismatch"] = train_metrics.get("train/logprob_diff_mean", float("nan"))
        m["policy_version"] = float(self.version)
        m["time/generation_s"] = gen_s
        m["time/sandbox_s"] = sum(e.sandbox_s for e in played)
        m["time/engine_s"] = sum(e.gen_s for e in played)
        m["time/training_s"] = train_s
        m["time/weight_sync_s"] = sync_s
        m["time/step_s"] = time.perf_counter() - t0
        m["episodes_per_s"] = (len(played) + len(failed)) / max(m["time/step_s"], 1e-9)
        m = dict(scalar_items(m))
        self._record_step(step, m, played)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
            await self._checkpoint()
        if cfg.eval.every and step % cfg.eval.every == 0 and self.eval_tasks:
            await self._evaluate(step)

    async def _sync_weights(self) -> None:
        """Push the trainer's weights into the engine; in async mode between engine steps."""
        paused = False
        if self.cfg.mode == "async" and self._can_pause:
            try:
                await self.engine.pause_generation(self.cfg.asynchronous.pause_mode)
                paused = True
            except EngineError as exc:
                if exc.status not in (404, 405):
                    raise
                self._can_pause = False
                self._log("engine has no pause_generation; weights update while it generates")
        try:
            await self.trainer.sync_weights([self.ep.engine_url], self.cfg.sync_method, str(self.version))
        finally:
            if paused:
                await self.engine.continue_generation()
        self.info.policy_version = self.version

    def _record_step(self, step: int, m: dict[str, float], played: list[Episode]) -> None:
        self.info.step = step
        self.info.last_metrics = {k: v for k, v in m.items() if "/" not in k or k.startswith(("time/", "train/"))}
        self.rd.write_info(self.info)
        self.rd.append("metrics.jsonl", {"step": step, "time": time.time(), **m})
        for e in played[:self.cfg.samples_per_step]:
            self.rd.append("samples.jsonl", self._sample(step, e))
        if self.tb:
            self.tb.scalars(step, m)
        self.prom.record_step(self.info.run_id, m)
        self.emit({"type": "step", "step": step, "metrics": m})

    def _sample(self, step: int, e: Episode) -> dict[str, Any]:
        return {"step": step, "task_id": e.task_id, "reward": e.reward, "success": e.success,
                "advantage": e.advantage, "policy_version": e.policy_version, "end_reason": e.end_reason,
                "answer": e.answer, "notes": e.verdict_notes,
                "turns": [{"text": t.text, "command": t.command, "exit_code": t.exit_code,
                           "observation": t.observation} for t in e.turns],
                "prompt_tokens": len(e.prompt_ids), "response_tokens": len(e.response_ids),
                "response_text": self.prompts.tok.decode(e.response_ids, skip_special_tokens=False)}

    async def _checkpoint(self) -> None:
        try:
            ck = await self.trainer.save_checkpoint("")
            self._log(f"checkpoint {ck.path} (step {ck.step}, policy version {ck.policy_version})")
        except TrainerError as exc:
            self._log(f"checkpoint failed: {exc}")

    async def _evaluate(self, step: int) -> None:
        """Greedy episodes on the held-out tasks, one each; recorded as the eval curve."""
        t0 = time.perf_counter()
        eps: list[Episode] = []
        progress = _Progress(self, step, len(self.eval_tasks), "eval")
        results = await asyncio.gather(*(self.player.play_group(t, 1, greedy=True, on_episode=progress.tick)
                                         for t in self.eval_tasks))
        for group in results:
            eps += group
        played = [e for e in eps if not e.failed]
        failed = [e for e in eps if e.failed]
        m = episode_metrics(played, failed, prefix="eval/")
        m["eval/time_s"] = time.perf_counter() - t0
        m = dict(scalar_items(m))
        self.rd.append("eval.jsonl", {"step": step, "time": time.time(), **m})
        for e in played:
            self.rd.append("eval_samples.jsonl", self._sample(step, e))
        if self.tb:
            self.tb.scalars(step, m)
        self.prom.eval_success.labels(self.info.run_id).set(m.get("eval/success_rate", 0.0))
        self.emit({"type": "eval", "step": step, "metrics": m})

    # ---- async mode -------------------------------------------------------------------------
    async def _run_async(self) -> None:
        """Producer plays groups continuously; each step takes the next finished groups."""
        cfg = self.cfg
        ready: asyncio.Queue[list[Episode]] = asyncio.Queue()
        # Groups played or waiting, at most staleness_k steps' worth: when generation is faster than
        # training, a group played while the trainer works on step s is normally taken within k steps.
        # A larger lead only plays groups that are dropped as stale. (A slow group still running
        # across a sync can be overtaken by newer ones and arrive too stale; that one is dropped.)
        in_flight = asyncio.Semaphore(max(1, cfg.asynchronous.staleness_k) * cfg.prompts_per_step)
        producer_stop = asyncio.Event()
        pending: set[asyncio.Task] = set()
        self._progress = _Progress(self, 1, cfg.prompts_per_step * cfg.group_size)

        async def one_group(task: Task) -> None:
            # The slot is freed when a step takes the group (or on failure).
            try:
                group = await self.player.play_group(task, cfg.group_size,
                                                     on_episode=lambda e: self._progress.tick(e))
            except BaseException:
                in_flight.release()
                raise
            await ready.put(group)

        async def produce() -> None:
            while not producer_stop.is_set():
                await in_flight.acquire()
                if producer_stop.is_set():
                    in_flight.release()
                    return
                t = asyncio.create_task(one_group(self.sampler.next()))
                pending.add(t)
                t.add_done_callback(pending.discard)

        producer = asyncio.create_task(produce())
        try:
            for step in range(1, cfg.steps + 1):
                if self.stop.is_set():
                    return
                t0 = time.perf_counter()
                self._progress = _Progress(self, step, cfg.prompts_per_step * cfg.group_size)
                stale_dropped = [0]
                staleness: list[int] = []

                async def take(step_: int, count: int) -> list[list[Episode]]:
                    out = []
                    while len(out) < count:
                        group = await ready.get()
                        in_flight.release()
                        group = self._apply_staleness(group, stale_dropped, staleness)
                        if group:
                            out.append(group)
                    return out

                got = await self._collect(step, take)
                await self._train_and_sync(step, got, t0, staleness or [0], stale_dropped[0])
        finally:
            producer_stop.set()
            producer.cancel()
            for t in list(pending):
                t.cancel()
            await asyncio.gather(producer, *pending, return_exceptions=True)

    def _apply_staleness(self, group: list[Episode], stale_dropped: list[int],
                         staleness: list[int]) -> list[Episode]:
        k = self.cfg.asynchronous.staleness_k
        out = []
        for e in group:
            if e.failed:
                out.append(e)
                continue
            lag = max(0, self.version - e.policy_version)
            if lag > k:
                if self.cfg.asynchronous.stale == "drop":
                    stale_dropped[0] += 1
                    continue
                e.weight = self.cfg.asynchronous.downweight ** (lag - k)
            staleness.append(lag)
            out.append(e)
        return out


class _Progress:
    """Emits a progress event per finished episode of a phase (the launcher draws bars from them)."""

    def __init__(self, loop: "RunLoop", step: int, total: int, phase: str = "generate") -> None:
        self.loop, self.step, self.total, self.phase = loop, step, total, phase
        self.done = self.failed = 0
        self._emit()

    def _emit(self) -> None:
        self.loop.emit({"type": "progress", "step": self.step, "phase": self.phase, "done": self.done,
                        "total": self.total, "failed": self.failed})

    def tick(self, ep: Optional[Episode] = None) -> None:
        self.done += 1
        if ep is not None and ep.failed:
            self.failed += 1
        self._emit()


def _failure_summary(failed: list[Episode]) -> str:
    counts = collections.Counter(e.failed for e in failed)
    first = {}
    for e in failed:
        first.setdefault(e.failed, e.error)
    return "; ".join(f"{r} x{n} (e.g. {first[r][:200]})" for r, n in counts.most_common()) or "no failures"


async def _wait_health(addr: str, timeout: float, stop: asyncio.Event) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if await check_health(addr):
            return True
        await asyncio.sleep(1.0)
    return False
