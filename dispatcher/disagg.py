"""Whether a request's prefill runs on a prefill worker, and which one. Pure: the dispatcher and the fleet
simulator call the same code.

The decode side is placed first (placement.choose, over the decode workers): that is where the KV will
live and where the prefix index says how much of the prompt is cached. Then, in `auto` mode, the two
ways of running the uncached prompt are priced in seconds with the placement's latency model
(plumbing.latency):

- here: the decode worker's predicted time to first token, the prefill queued there ahead of the
  prompt's uncached tokens included; and the prompt's prefill time stalls the next token of every
  request already running there and the start of every request waiting there;
- split: the prefill worker's predicted time to first token for the prompt less what it has cached
  itself (its own queue ahead of it), then the KV of the whole prompt moved (a fixed cost plus a cost
  per token) and the decode worker's next step; loading it stalls the decode worker's running requests
  only for the transfer.

Each side's cost is its first-token time plus `stall_weight` times the stall it puts on other requests;
the request is split when that is lower and at least `min_uncached_tokens` are uncached. `threshold` is
llm-d's rule, `always` and `never` the two fixed policies, kept for comparison.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from plumbing.latency import predicted_ttft, prefill_s
from queue_schemas.config import DisaggregationConfig
from queue_schemas.messages import Heartbeat, WorkerState


@dataclass(frozen=True, slots=True)
class PrefillSide:
    """A prefill worker as the dispatcher sees it: its heartbeat, the prompt tokens of the jobs sent to it
    since, and how much of this prompt it has cached."""

    heartbeat: Heartbeat
    sent_tokens: int = 0
    matched_tokens: int = 0

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id

    def backlog(self) -> int:
        return self.heartbeat.prefill_backlog + self.sent_tokens


@dataclass(frozen=True, slots=True)
class SplitCase:
    """What the decision is judged from."""

    prompt_tokens: int
    decode_cached: int  # prompt tokens the decode worker holds (its prefix index)
    decode_running: int  # requests running on the decode worker
    decode_rate: float  # prompt tokens per second the decode worker prefills
    decode_waiting: int = 0  # requests waiting at the decode worker (a local prefill delays them too)
    prefill_cached: int = 0
    prefill_backlog: int = 0  # prompt tokens queued at the prefill worker
    prefill_rate: float = 1.0
    decode_backlog: int = 0  # uncached prompt tokens queued at the decode worker
    decode_step_s: float = 0.0  # a decode step on each side (0: not known, no step time counted)
    prefill_step_s: float = 0.0
    chunk_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class SplitVerdict:
    split: bool
    reason: str
    local_s: float = 0.0
    split_s: float = 0.0


def costs(case: SplitCase, config: DisaggregationConfig) -> tuple[float, float]:
    """The cost in seconds of prefilling on the decode worker, and of the split (see the module doc)."""
    uncached = max(1, case.prompt_tokens - case.decode_cached)
    chunk = case.chunk_tokens
    here = float(predicted_ttft(uncached, case.decode_backlog, case.decode_rate, case.decode_step_s, chunk))
    stall = float(prefill_s(uncached, case.decode_rate, case.decode_step_s, chunk))
    local = here + config.stall_weight * (case.decode_running + case.decode_waiting) * stall
    transfer = config.transfer_fixed_s + config.transfer_s_per_token * case.prompt_tokens
    computed = max(1, case.prompt_tokens - case.prefill_cached)
    prefilled = predicted_ttft(computed, case.prefill_backlog, case.prefill_rate, case.prefill_step_s, chunk)
    first = float(prefilled) + transfer + 1.5 * case.decode_step_s  # then a decode step brings the token
    split = first + config.stall_weight * case.decode_running * transfer
    return local, split


def decide_split(case: SplitCase, config: DisaggregationConfig) -> SplitVerdict:
    """Whether to run the prompt on the prefill worker (the case's prefill side is the best one free)."""
    uncached = max(0, case.prompt_tokens - case.decode_cached)
    if config.mode == "never":
        return SplitVerdict(False, "never")
    if config.mode == "always":
        return SplitVerdict(True, "always")
    if config.mode == "threshold":
        split = uncached >= config.threshold_tokens
        return SplitVerdict(split, "over threshold" if split else "under threshold")
    local, split_s = costs(case, config)
    if uncached < config.min_uncached_tokens:
        return SplitVerdict(False, "short uncached prompt", local, split_s)
    if split_s < local:
        return SplitVerdict(True, "split is cheaper", local, split_s)
    return SplitVerdict(False, "local is cheaper", local, split_s)


def prefill_rate(hb: Heartbeat, fallback: float) -> float:
    """A worker's measured prefill rate, or `fallback` until it has measured one."""
    return hb.prefill_tokens_per_s if hb.prefill_tokens_per_s > 0 else fallback


def choose_prefill(
    sides: Sequence[PrefillSide],
    prompt_tokens: int,
    now: float,
    config: DisaggregationConfig,
    rng: random.Random,
) -> PrefillSide | None:
    """The ready prefill worker that would finish this prompt soonest (its queue, then the prompt less
    what it has cached); ties at random. None when no prefill worker is ready."""
    ready = [
        s
        for s in sides
        if s.heartbeat.state is WorkerState.READY
        and s.heartbeat.role == "prefill"
        and now - s.heartbeat.sent_at <= s.heartbeat.ttl_ms / 1000
    ]
    if not ready:
        return None

    def finish_s(side: PrefillSide) -> float:
        rate = prefill_rate(side.heartbeat, config.prefill_tokens_per_s)
        return (side.backlog() + max(0, prompt_tokens - side.matched_tokens)) / rate

    best = min(finish_s(s) for s in ready)
    return rng.choice([s for s in ready if finish_s(s) <= best + 1e-9])


def split_case(
    prompt_tokens: int,
    decode: Heartbeat,
    decode_cached: int,
    side: PrefillSide,
    config: DisaggregationConfig,
    decode_waiting: int = 0,
    decode_backlog: int = 0,
) -> SplitCase:
    """The case for one decode worker and one prefill worker. A decode worker that has not measured its
    prefill rate is taken to prefill as fast as the prefill worker (the same model on the same kind of
    machine), else the pool's configured rate."""
    side_rate = prefill_rate(side.heartbeat, config.prefill_tokens_per_s)
    return SplitCase(
        prompt_tokens=prompt_tokens,
        decode_cached=decode_cached,
        decode_running=decode.running,
        decode_rate=prefill_rate(decode, side_rate),
        decode_waiting=decode_waiting,
        prefill_cached=side.matched_tokens,
        prefill_backlog=side.backlog(),
        prefill_rate=side_rate,
        decode_backlog=decode_backlog,
        decode_step_s=decode.step_s,
        prefill_step_s=side.heartbeat.step_s,
    )
