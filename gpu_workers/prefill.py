"""Prefill/decode handoffs between workers, both sides.

- A decode worker given a request with a handoff pushes a PrefillJob to the prefill worker's list and
  waits for its KvReady on the request's `kv_ready` list. Whatever goes wrong there (the prefill worker
  gone, its answer late or a failure) ends in a local prefill, never an error: the request runs here
  without loading. Its outcome is kept in the request's `handoff` record and the worker's metrics.
- A prefill worker takes jobs one at a time (one step per prompt, so the connector saves it whole), runs
  each for one token with the connector saving its KV, checks what was saved, and answers.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gpu_workers import metrics
from gpu_workers.engine import Engine, EngineError
from gpu_workers.handoff import KvTransfer, PrefillRate, kv_folder, remove_kv, sweep
from plumbing.health import item_failed
from queue_schemas.codec import decode, encode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import (
    Heartbeat,
    InferenceRequest,
    KvReady,
    PrefillJob,
    SamplingParams,
    WorkerState,
)
from queue_schemas.names import Names

log = structlog.get_logger("sluice.worker.handoff")

WAIT_SLICE_S = 0.5  # how often a waiting decode worker checks that the prefill worker is alive
RECORD_TTL_S = 3600
SWEEP_EVERY_S = 30.0
PREFILL_ITEMS = "worker.prefill_job"  # the `loop` label of prefill jobs ended alone


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a decode worker's wait for a handoff ended: `loaded` (kv set), or a fallback reason."""

    kind: str
    kv: KvTransfer | None = None
    waited_s: float = 0.0
    prefill_s: float = 0.0


def prefill_request(request: InferenceRequest) -> InferenceRequest:
    """What a prefill worker runs: the prompt, greedy, for one token, without the request's handoff or
    output constraints (only the prompt's KV matters). Pure."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    return request.model_copy(update={"sampling": sampling, "handoff": None, "resume": None})


def saved_rows(folder: Path) -> set[int]:
    """The row counts (tokens) of every layer file the shared-storage connector wrote, read from each
    safetensors header only."""
    rows: set[int] = set()
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        rows.add(int(header["kv_cache"]["shape"][0]))
    return rows


def expected_rows(prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens the connector saves and loads: whole blocks of the prompt less its last token."""
    return (prompt_tokens - 1) // block_size * block_size


class HandoffDesk:
    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        engine: Engine,
        worker_id: str,
        pool: str,
        block_size: int,
        storage: Path | None,
        kv_ttl_s: float,
    ) -> None:
        self._redis = redis
        self._names = names
        self._engine = engine
        self._worker_id = worker_id
        self._pool = pool
        self._block_size = block_size
        self._storage = storage
        self._kv_ttl_s = kv_ttl_s
        self.rate = PrefillRate()
        self._jobs: deque[PrefillJob] = deque()
        self._current = 0  # prompt tokens of the job running now

    # the prefill side
    @property
    def backlog(self) -> int:
        """Prompt tokens of the jobs taken and not finished."""
        return self._current + sum(len(j.request.prompt_token_ids) for j in self._jobs)

    async def serve_jobs(self, ready: asyncio.Event) -> None:
        """Take and run prefill jobs until cancelled (started once the engine is ready)."""
        await ready.wait()
        key = self._names.prefill_jobs(self._worker_id)
        swept = time.monotonic()
        while True:
            try:
                if not self._jobs:
                    popped = await self._redis.blpop([key], timeout=1)
                    if popped is not None:
                        self._take(popped[1])
                more = await self._redis.lpop(key, 64)
                for raw in more or []:
                    self._take(raw)
            except RedisError as exc:
                log.warning("prefill jobs not read", error=str(exc))
                await asyncio.sleep(0.5)
                continue
            if self._jobs:
                job = self._jobs.popleft()
                self._current = len(job.request.prompt_token_ids)
                try:
                    await self._run(job)
                except Exception as exc:  # this job alone: its decode worker stops waiting at its deadline
                    item_failed(PREFILL_ITEMS)
                    log.error("prefill job dropped", error=type(exc).__name__, exc_info=True)
                finally:
                    self._current = 0
            if self._storage is not None and time.monotonic() - swept > SWEEP_EVERY_S:
                swept = time.monotonic()
                try:
                    removed = await asyncio.to_thread(sweep, self._storage, self._kv_ttl_s)
                except Exception as exc:  # tried again at the next sweep
                    log.warning("handoff KV not swept", error=str(exc))
                    continue
                if removed:
                    log.info("removed handoff KV left behind", folders=removed)

    def _take(self, raw: object) -> None:
        if not isinstance(raw, bytes | str):
            return
        try:
            self._jobs.append(decode(PrefillJob, raw))
        except SchemaError as exc:
            item_failed(PREFILL_ITEMS)
            log.error("bad prefill job dropped", reason=str(exc))

    async def _run(self, job: PrefillJob) -> None:
        started = time.monotonic()
        request = job.request
        if time.time() > job.deadline:
            await self._answer(
                job, False, 0.0, "the decode worker stopped waiting before the job started", None
            )
            return
        error = None
        remote = None
        computed = len(request.prompt_token_ids)
        try:
            kv = KvTransfer(job.handoff_id, save=True)
            async for out in self._engine.generate(prefill_request(request), kv):
                remote = out.kv_params or remote
                computed = out.prompt_tokens - out.cached_tokens if out.prompt_tokens else computed
            if self._storage is not None:
                error = await asyncio.to_thread(self._check_saved, job)
        except EngineError as exc:
            error = f"prefill failed: {exc}"
        except Exception as exc:  # a fault of this job alone: it fails, the worker goes on
            item_failed(PREFILL_ITEMS)
            log.error(
                "prefill job raised", request_id=request.request_id, error=type(exc).__name__, exc_info=True
            )
            error = f"prefill failed: {type(exc).__name__}"
        seconds = time.monotonic() - started
        if error is None:
            self.rate.record(computed, seconds)
        else:
            log.warning("prefill job failed", request_id=request.request_id, error=error)
        metrics.PREFILL_JOBS.labels(self._pool, "ok" if error is None else "failed").inc()
        await self._answer(job, error is None, seconds, error, remote)

    def _check_saved(self, job: PrefillJob) -> str | None:
        """Whether the connector saved the whole prompt's KV (what the decode side will load)."""
        assert self._storage is not None
        folder = kv_folder(self._storage, job.handoff_id)
        want = expected_rows(len(job.request.prompt_token_ids), self._block_size)
        rows = saved_rows(folder) if folder.is_dir() else set()
        if rows != {want}:
            remove_kv(self._storage, job.handoff_id)
            return f"the KV saved covers {sorted(rows)} tokens, not {want}"
        return None

    async def _answer(
        self, job: PrefillJob, ok: bool, seconds: float, error: str | None, remote: dict[str, Any] | None
    ) -> None:
        ready = KvReady(
            handoff_id=job.handoff_id, worker_id=self._worker_id, ok=ok, prefill_s=seconds, error=error,
            remote=remote,
        )  # fmt: skip
        key = self._names.kv_ready(job.request.request_id)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, encode(ready))
                pipe.expire(key, RECORD_TTL_S)
                await pipe.execute()
        except RedisError as exc:
            log.warning("prefill answer not sent", request_id=job.request.request_id, error=str(exc))

    # the decode side
    async def await_kv(self, request: InferenceRequest) -> Outcome:
        """Ask the request's prefill worker for its KV and wait for it (see the module doc)."""
        handoff = request.handoff
        assert handoff is not None
        started = time.monotonic()
        deadline = started + handoff.wait_s
        job = PrefillJob(
            handoff_id=handoff.id,
            decode_worker=self._worker_id,
            request=request.model_copy(update={"handoff": None}),
            deadline=time.time() + handoff.wait_s,
        )
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.rpush(self._names.prefill_jobs(handoff.prefill_worker), encode(job))
                pipe.expire(self._names.prefill_jobs(handoff.prefill_worker), int(handoff.wait_s) + 1)
                await pipe.execute()
            kind, ready = await self._wait(request, deadline)
        except RedisError as exc:
            log.warning(
                "handoff not possible; prefilling here", request_id=request.request_id, error=str(exc)
            )
            kind, ready = "bus unavailable", None
        waited = time.monotonic() - started
        outcome = Outcome(kind, None, waited, 0.0 if ready is None else ready.prefill_s)
        if kind == "loaded" and ready is not None:
            kv = KvTransfer(handoff.id, save=False, remote=ready.remote)
            outcome = Outcome(kind, kv, waited, ready.prefill_s)
        metrics.HANDOFFS.labels(self._pool, "loaded" if kind == "loaded" else "fallback").inc()
        metrics.HANDOFF_SECONDS.labels(self._pool).observe(waited)
        await self._record(request, outcome)
        if kind != "loaded":
            log.warning("handoff fell back to a local prefill", request_id=request.request_id, reason=kind)
        return outcome

    async def _wait(self, request: InferenceRequest, deadline: float) -> tuple[str, KvReady | None]:
        handoff = request.handoff
        assert handoff is not None
        key = self._names.kv_ready(request.request_id)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timed out", None
            popped = await self._redis.blpop([key], timeout=min(WAIT_SLICE_S, left))
            if popped is not None:
                try:
                    ready = decode(KvReady, popped[1])
                except SchemaError:
                    continue
                if ready.handoff_id != handoff.id:
                    continue  # an earlier placement's answer
                return ("loaded" if ready.ok else "prefill failed"), ready
            if not await self._alive(handoff.prefill_worker):
                return "prefill worker lost", None

    async def _alive(self, worker_id: str) -> bool:
        raw = await self._redis.get(self._names.heartbeat(self._pool, worker_id))
        if raw is None:
            return False
        try:
            return decode(Heartbeat, raw).state is not WorkerState.FAILED
        except SchemaError:
            return False

    async def _record(self, request: InferenceRequest, outcome: Outcome) -> None:
        handoff = request.handoff
        assert handoff is not None
        key = self._names.handoff(request.request_id)
        fields: dict[str | bytes, str | bytes] = {
            "prefill_worker": handoff.prefill_worker,
            "decode_worker": self._worker_id,
            "outcome": outcome.kind,
            "waited_s": f"{outcome.waited_s:.4f}",
            "prefill_s": f"{outcome.prefill_s:.4f}",
        }
        totals = self._names.handoff_totals(self._pool)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                pipe.expire(key, RECORD_TTL_S)
                pipe.hincrby(totals, "loaded" if outcome.kind == "loaded" else "fallback", 1)
                pipe.hincrby(totals, "wait_ms", round(outcome.waited_s * 1000))
                await pipe.execute()
        except RedisError as exc:
            log.warning("handoff record not written", request_id=request.request_id, error=str(exc))

    async def release(self, kv: KvTransfer) -> None:
        """Remove a loaded handoff's KV (the decode worker holds it in its own cache now)."""
        if self._storage is not None:
            await asyncio.to_thread(remove_kv, self._storage, kv.handoff_id)
