"""The dispatcher's background loops: the worker view and the recovery of lost workers' requests, team
weights, the prefix index, and heartbeats pushed by workers."""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
from redis.exceptions import RedisError

from dispatcher import metrics
from dispatcher.hold import Held, team_weights
from dispatcher.placing import Placing
from dispatcher.recovery import take_over
from plumbing.clients import mget_any
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import (
    Heartbeat,
)

log = structlog.get_logger("sluice.dispatcher")


class Refreshers(Placing):
    async def _view_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                gone = await self.view.refresh()
                # Right after Redis comes back, heartbeats that lapsed while it was away are being
                # renewed: a worker is taken for lost only once it had a whole grace period to beat.
                if time.monotonic() - self._redis_failed_at >= self.settings.recovery_grace_s:
                    for worker_id in gone:
                        await self._recover(worker_id)
            except RedisError as exc:
                self._redis_failed_at = time.monotonic()
                log.warning("worker view refresh failed", error=str(exc))
            await asyncio.sleep(self.settings.view_refresh_s)

    async def _recover(self, worker_id: str) -> None:
        requests = await take_over(self.redis, self.names, self.pool, worker_id)
        # An inbox a restarted worker handed over holds requests placed on that worker's own id.
        owner = await self.redis.get(self.names.left_by(worker_id)) if requests else None
        placed_on = owner.decode() if isinstance(owner, bytes) else worker_id
        for request in requests or ():
            held = Held(request, None, None, time.monotonic(), moved_from=placed_on, taken_over=request)
            # Before it joins the hold: one that ended or cannot move is answered now, and a
            # continuation is bound by its deadline only, not by the start-by time of a queued request.
            try:
                to_place = await self._prepare_move(held) is not None
            except RedisError:  # its inbox entry is gone: it is held, and prepared again at its turn
                to_place = True
            if to_place and self.hold.add(held):
                metrics.RECOVERED.labels(self.pool).inc()

    async def _weights_loop(self, stop: asyncio.Event) -> None:
        """Keep the hold's team weights to the team records, re-read every few seconds."""
        while not stop.is_set():
            teams = sorted(self.hold.teams())
            if teams:
                try:
                    raw = await mget_any(self.redis, [self.names.team(t) for t in teams])
                    self.hold.set_weights(team_weights(teams, raw))
                except RedisError as exc:
                    log.warning("team weights not read", error=str(exc))
            await asyncio.sleep(self.settings.weights_refresh_s)

    async def _kv_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if not await self.view.read_kv_events(block_ms=100):
                    await asyncio.sleep(0.05)
            except RedisError as exc:
                log.warning("prefix index read failed", error=str(exc))
                await asyncio.sleep(0.5)

    def _on_heartbeat(self, data: bytes) -> None:
        """Heartbeats pushed by workers, so a new or recovered worker is seen before the next re-read."""
        with contextlib.suppress(SchemaError):
            self.view.on_heartbeat(decode(Heartbeat, data))
