"""Deciding and acting: held requests, in priority and fairness order, offered to placement; a claim
and an inbox append for the chosen worker; a prefill handoff where the split decision says so; a lost
worker's request readied to move."""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections import Counter
from functools import partial
from typing import Literal

import structlog
from redis.exceptions import RedisError

from dispatcher import metrics, tracing
from dispatcher.batch_desk import Refusal, Reserve
from dispatcher.disagg import choose_prefill, decide_split, split_case
from dispatcher.ending import Ending
from dispatcher.hold import Held
from dispatcher.migration import decide_move
from dispatcher.placement import AFFINITY_REASON, SLO_REASON, Decision, Demand, choose_least_loaded
from plumbing import tracing as plumbing_tracing
from plumbing.clients import BusUnavailable
from plumbing.replay import LogState, read_log_state
from plumbing.tracing import current as tracing_current
from plumbing.tracing import logging_for as tracing_logs
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import (
    Handoff,
    InferenceRequest,
    PlacementNote,
    Priority,
    Tier,
    Usage,
)
from queue_schemas.usage import UsageStatus

log = structlog.get_logger("sluice.dispatcher")
MAX_PREDICTED_S = 86_400.0  # a prediction past a day (a worker finishing nothing) is sent as a day


def demand_of(request: InferenceRequest, waited_s: float, light: bool, first_try: bool) -> Demand:
    """What placement is asked for a held request. A request taken over from a lost worker
    (`first_try` false) or continuing a moved answer has no TTFT SLO left to hold it for, and is never
    refused; otherwise only a flex-tier interactive request may be refused to keep its SLO."""
    interactive = request.priority is Priority.INTERACTIVE
    fresh = first_try and request.resume is None
    ttft_slo_s = None if request.ttft_slo_ms is None else request.ttft_slo_ms / 1000
    return Demand(
        len(request.prompt_token_ids),
        request.block_hashes,
        request.sampling.max_tokens,
        request.priority,
        waited_s,
        light=interactive and light,
        adapter=request.adapter,
        ttft_slo_s=ttft_slo_s if fresh else math.inf,
        tpot_slo_s=None if request.tpot_slo_ms is None else request.tpot_slo_ms / 1000,
        sheddable=interactive and fresh and request.tier is Tier.FLEX,
    )


def placement_note(decision: Decision, now: float) -> PlacementNote | None:
    """What the worker is told of the prediction (None where the model did not choose)."""
    if math.isnan(decision.predicted_ttft_s):
        return None
    predicted = min(decision.predicted_ttft_s, MAX_PREDICTED_S)
    return PlacementNote(placed_at=now, predicted_ttft_s=predicted, uncached_tokens=decision.uncached_tokens)


# `waits`: for a busy worker holding its prefix; `slo`: for a worker that meets its SLO. Either says
# nothing of the other requests.
Tried = Literal["placed", "full", "waits", "slo"]


class Placing(Ending):
    async def _place_held(self) -> None:
        """Offer the held requests to placement in order. A round ends after `max_misses_per_round`
        requests in a row fit nowhere. A request that waits for its own SLO or for the busy worker
        holding its prefix does not end it: the requests go on being tried (a team's stop once that
        many of them waited so, so one team's waiting requests cannot hold the others' back). After a
        request waits for its SLO, the round ends at the next band, which must not take the capacity
        it waits for."""
        if not len(self.hold):
            return
        misses = batch_tries = 0
        waits: Counter[str] = Counter()
        waiting_band: int | None = None  # the best band of a request that waits for its SLO
        now = time.time()
        for held in list(self.hold.ordered()):
            if held.not_before > now:
                continue
            team = held.request.team
            if waits[team] >= self.settings.max_misses_per_round:
                continue
            if waiting_band is not None and held.request.band > waiting_band:
                break  # a lower band does not take what a waiting request of a higher one waits for
            if held.request.priority is Priority.BATCH:
                batch_tries += 1
                if batch_tries > self.settings.batch_per_round:
                    break  # back to receiving, so an interactive request never waits behind a long round
            tag = self.hold.tag(held.request.team)  # as it stands now: earlier placements are charged
            if held.request.fair_tag != tag:
                held.request = held.request.model_copy(update={"fair_tag": tag})
            try:
                with tracing_logs(held.traceparent):
                    tried = await self._try_place(held)
            except (RedisError, BusUnavailable):
                raise  # the loop's own pause: the request stays held
            except Exception as exc:  # a fault of this request's alone: it ends, the round goes on
                self._end_failed(held, exc)
                tried = "placed"
            if tried in ("waits", "slo"):
                waits[team] += 1
                if tried == "slo":
                    band = held.request.band
                    waiting_band = band if waiting_band is None else min(waiting_band, band)
                continue
            misses = 0 if tried == "placed" else misses + 1
            if misses >= self.settings.max_misses_per_round:
                break  # nothing fits now; the rest of the hold waits for the next heartbeat
        self._export_hold()

    async def _try_place(self, held: Held) -> Tried:
        """`placed` when the request left the hold (placed, answered or ended), `waits` or `slo` when it
        waits for a reason of its own, `full` when it fits nowhere now."""
        log_ = None
        if held.taken_over is not None:
            log_ = await self._prepare_move(held)
            if log_ is None:
                return "placed"
        request = held.request
        waited = max(0.0, time.monotonic() - held.arrived)
        demand = demand_of(request, waited, self.hold.held_of(request.team) <= 1, held.taken_over is None)
        t0, started = time.perf_counter(), time.time()
        if self.settings.placement == "scored":
            decision = self.view.decide(demand, time.time(), self.policy, self.rng, plumbing_tracing.ENABLED)
        else:
            snapshot = self.view.snapshot(request.block_hashes)
            decision = choose_least_loaded(snapshot, demand, time.time(), self.policy, self.rng)
        handoff = None
        if decision.worker_id is not None and self.disaggregation is not None:
            handoff = self._handoff(request, decision.worker_id, decision.matched_blocks)
        metrics.DECISION_SECONDS.labels(self.pool).observe(time.perf_counter() - t0)
        if decision.refused:
            await self._shed(held, f"{decision.reason} ({demand.ttft_slo_s or self.policy.ttft_slo_s:g} s)")
            return "placed"
        if decision.worker_id is None:
            held.waited_for = decision.reason
            if decision.reason == SLO_REASON:
                return "slo"
            return "waits" if decision.reason == AFFINITY_REASON else "full"
        # A split request's prompt is computed by its prefill worker: the decode worker queues none of it,
        # and the prediction (of a local prefill) is not what its first token measures.
        note = None if handoff is not None else placement_note(decision, time.time())
        if handoff is not request.handoff or note != request.placement:
            held.request = request = request.model_copy(update={"handoff": handoff, "placement": note})
        reserved = await self.batch.reserve(held)
        if isinstance(reserved, Refusal):
            self._answer_soon(held, reserved.send)
            return "placed"
        if reserved is not Reserve.GO:
            return "full"
        continued = held.request.resume is not None and held.request is not held.taken_over
        span = tracing.placing(held, decision, self.block_size, started)
        outcome = "failed"
        try:
            with tracing_current(span):
                outcome = await self.acts.place(held, decision, log_)
        finally:
            tracing.placed(span, held, outcome)
        request = held.request
        if outcome == "placed":
            if held.taken_over is not None:
                await self._count_move("moved" if continued else "restarted")
                log.info(
                    "request of a lost worker placed again", request_id=request.request_id,
                    worker=decision.worker_id, moved_from=held.moved_from, continued=continued,
                )  # fmt: skip
            self._finish(held)
            self.hold.charge(request.team, held.cost)
            metrics.TEAM_PLACED_TOKENS.labels(self.pool, request.team).inc(held.cost)
            local = 0 if request.handoff is not None else decision.uncached_tokens
            self.view.record_placement(
                decision.worker_id, decision.blocks_needed, request.block_hashes, local
            )
            if request.handoff is not None:
                self.view.record_prefill(
                    request.handoff.prefill_worker, len(request.prompt_token_ids), request.block_hashes
                )
            metrics.PLACEMENTS.labels(self.pool).inc()
            metrics.QUEUED_SECONDS.labels(self.pool).observe(time.monotonic() - held.arrived)
            metrics.PREFIX_BLOCKS.labels(self.pool, "prompt").inc(len(request.block_hashes))
            metrics.PREFIX_BLOCKS.labels(self.pool, "matched").inc(decision.matched_blocks)
            return "placed"
        if outcome == "changed":
            return "full"  # the lost worker's log grew meanwhile: read again next round
        metrics.OUTCOMES.labels(self.pool, outcome).inc()
        if outcome == "cancelled":
            await self._settle_ended(request, UsageStatus.CANCELLED, ErrorCode.CANCELLED)
            if request.batch is not None:
                self._answer_cancelled(held)  # it leaves the hold once the answer is out
                return "placed"
        self._finish(held)
        return "placed"

    def _handoff(self, request: InferenceRequest, decode_worker: str, matched_blocks: int) -> Handoff | None:
        """A handoff to the best prefill worker when the split decision says so (dispatcher.disagg).
        A moved request (its prompt holds delivered output) and a batch request prefill where they
        decode."""
        config = self.disaggregation
        decode = self.view.heartbeats.get(decode_worker)
        if config is None or decode is None or request.resume is not None or request.batch is not None:
            return None
        prompt = len(request.prompt_token_ids)
        sides = self.view.prefill_sides(request.block_hashes)
        side = choose_prefill(sides, prompt, time.time(), config, self.rng)
        if side is None:
            metrics.SPLITS.labels(self.pool, "local", "no prefill worker ready").inc()
            return None
        waiting = self.view.waiting(decode_worker)
        backlog = self.view.prefill_work(decode_worker, time.time())
        case = split_case(prompt, decode, matched_blocks * self.block_size, side, config, waiting, backlog)
        verdict = decide_split(case, config)
        metrics.SPLITS.labels(self.pool, "split" if verdict.split else "local", verdict.reason).inc()
        if not verdict.split:
            return None
        return Handoff(id=secrets.token_hex(16), prefill_worker=side.worker_id, wait_s=config.handoff_wait_s)

    async def _prepare_move(self, held: Held) -> LogState | None:
        """Ready a request taken over from a lost worker for placement, from what its replay log shows
        was delivered (dispatcher.migration): the request whole, or its continuation. Returns the log as
        read (its placement goes ahead only while the log is so), or None when it needs no placement: it
        had ended, or cannot move and is answered with worker_lost after what its client has."""
        lost = held.taken_over
        assert lost is not None
        log_ = await read_log_state(self.redis, self.names, lost.request_id)
        move = decide_move(lost, log_.events, self.max_migrations, self.block_size)
        held.request = move.request
        if move.outcome in ("restarted", "moved"):
            return log_  # counted once placed
        await self._count_move(move.outcome)
        if move.outcome == "ended":
            self._finish(held)
            return None
        metrics.OUTCOMES.labels(self.pool, "worker_lost").inc()
        log.warning("request of a lost worker cannot move", request_id=lost.request_id, reason=move.reason)
        prompt = min(move.used_tokens, lost.client_prompt_tokens)
        usage = Usage(prompt_tokens=prompt, completion_tokens=move.used_tokens - prompt)
        await self._settle_ended(lost, UsageStatus.FAILED, ErrorCode.WORKER_LOST, usage)
        message = f"the worker serving the request was lost, and {move.reason}"
        self._answer_soon(
            held, partial(self._answer_error, lost, ErrorCode.WORKER_LOST, message, move.logged)
        )
        return None

    async def _count_move(self, outcome: str) -> None:
        """In this process's metrics, and in Redis for the scaler's dashboard (all dispatchers summed)."""
        metrics.MIGRATIONS.labels(self.pool, outcome).inc()
        with contextlib.suppress(RedisError):
            await self.redis.hincrby(self.names.migrations(self.pool), outcome, 1)

    def _export_hold(self) -> None:
        for priority in Priority:
            metrics.HOLD_SIZE.labels(self.pool, priority.value).set(self.hold.size(priority))
        held = self.hold.held_by_team()
        for team in self._teams_seen - held.keys():
            metrics.TEAM_HELD.labels(self.pool, team).set(0)
        for team, count in held.items():
            metrics.TEAM_HELD.labels(self.pool, team).set(count)
        self._teams_seen |= held.keys()
