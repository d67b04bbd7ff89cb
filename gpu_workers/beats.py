"""What a worker tells the dispatchers: its heartbeat (state, slots, KV headroom, adapters, rates) and its
KV-cache events for the prefix index."""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.exceptions import RedisError

from gpu_workers.parts import KV_PUBLISH_INTERVAL_S, WorkerParts, log
from gpu_workers.presence import (
    Vitals,
    beat_forever,
    engine_load,
    heartbeat,
    state_on_drain_request,
    write_state_file,
)
from plumbing.health import item_failed
from plumbing.state import publish_heartbeat
from queue_schemas.messages import (
    WorkerState,
)


class Beats(WorkerParts):
    async def _kv_loop(self) -> None:
        while True:
            await asyncio.sleep(KV_PUBLISH_INTERVAL_S)
            self.liveness.beat("kv-events")
            if self.state in (WorkerState.STARTING, WorkerState.FAILED):
                continue
            try:
                await self.kv.publish(self.engine.take_kv_changes())
            except RedisError as exc:
                # The mirror moved on: consumers see a gap and resync from the next snapshot.
                log.warning("kv events not published", error=str(exc))
            except Exception as exc:  # these changes are lost alone; consumers resync the same way
                item_failed("worker.kv_events")
                log.error("kv events dropped", error=type(exc).__name__, exc_info=True)

    async def _heartbeat_loop(self) -> None:
        await beat_forever(self._heartbeat_round, self.settings.heartbeat_interval_s, self._beat_soon)

    async def _heartbeat_round(self) -> None:
        """One heartbeat; one that cannot be built or written (other than Redis failing) is skipped."""
        self.liveness.beat("heartbeat")
        try:
            await self._publish_heartbeat()
        except RedisError:
            raise
        except Exception as exc:
            item_failed("worker.heartbeat")
            log.error("heartbeat skipped", error=type(exc).__name__, exc_info=True)

    async def _publish_heartbeat(self) -> None:
        if not self._exiting and self.state in (WorkerState.READY, WorkerState.DRAINING):
            asked = bool(await self.redis.exists(self.names.drain_request(self.settings.worker_id)))
            state = state_on_drain_request(self.state, asked)
            if state is not self.state:
                log.info("drain requested" if asked else "drain withdrawn", worker=self.settings.worker_id)
            self.state = state
        # Awaited before the fields are read, so one heartbeat never mixes states from either side of it.
        inbox_pending = await self.inbox.undelivered() + len(self.slots.ready)
        self._hb_seq += 1
        hb = heartbeat(
            self.settings, self.model, self.vitals(), engine_load(self.engine.stats(), len(self._tasks)),
            inbox_pending, seq=self._hb_seq, kv_seq=self.kv.seq,
            completed_per_s=self.completions.rate(time.monotonic()),
        )  # fmt: skip
        if self.settings.role != "prefill":
            ledger = self.first_tokens
            hb = hb.model_copy(
                update={
                    "prefill_backlog": max(0, ledger.backlog(hb.sent_at)),
                    "prefill_tokens_per_s": ledger.rate,
                    "adapters_in_use": self.slots.adapters_in_use(),
                    "step_s": ledger.step_s,
                    "ttft_correction": min(1000.0, max(1e-3, ledger.correction.factor)),
                    "ttft_error": ledger.correction.error,
                }
            )
        if self.handoffs is not None and self.settings.role == "prefill":
            hb = hb.model_copy(
                update={
                    "prefill_tokens_per_s": self.handoffs.rate.tokens_per_s,
                    "prefill_backlog": self.handoffs.backlog,
                }
            )
        await publish_heartbeat(self.redis, self.names, hb)
        if self.settings.state_file is not None:
            write_state_file(self.settings.state_file, hb.state)

    def vitals(self) -> Vitals:
        return Vitals(
            self.state, self.started_at, self.load_seconds, self.ready_at, self.error,
            self.max_running, self.tensor_parallel_size, self.light_slots,
        )  # fmt: skip

    async def _publish_heartbeat_quietly(self) -> None:
        with contextlib.suppress(RedisError):
            await self._publish_heartbeat()
