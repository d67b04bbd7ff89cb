"""Consumer-lag arithmetic. Pure.

Lag of a partition = end offset - committed offset, as on Apache Kafka. Where the group has not
committed, everything from the log start is lag (the dispatchers reset to earliest). The result is
clamped at zero: the dev broker (Tansu) can report an end offset below the true one when the last
batch held several records, and a negative lag is never meaningful.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from queue_schemas.messages import POOL_STATE_STALE_S, Heartbeat, PoolState, WorkerState


def partition_lag(end_offset: int, committed: int | None, log_start: int = 0) -> int:
    start = committed if committed is not None and committed >= 0 else log_start
    return max(0, end_offset - start)


@dataclass(frozen=True, slots=True)
class PoolLag:
    pool: str
    topic: str
    group: str
    partitions: Mapping[int, int]
    read_at: float
    committed: Mapping[int, int] = field(default_factory=dict)
    end_total: int = 0  # every request ever produced to the topic (arrivals)

    @property
    def total(self) -> int:
        return sum(self.partitions.values())


def pool_lag(
    pool: str,
    topic: str,
    group: str,
    end_offsets: Mapping[int, int],
    committed: Mapping[int, int | None],
    log_starts: Mapping[int, int],
    read_at: float,
    highwater: Mapping[int, int] | None = None,
) -> PoolLag:
    """Lag of every partition. `highwater`: marks consumers saw in fetch responses; the larger of it and
    the listed end offset counts, which keeps lag right where a broker's ListOffsets undercounts."""
    marks = highwater or {}
    ends = {p: max(end, marks.get(p, 0)) for p, end in end_offsets.items()}
    lags = {p: partition_lag(end, committed.get(p), log_starts.get(p, 0)) for p, end in sorted(ends.items())}
    positions = {p: max(0, c) for p, c in committed.items() if c is not None}
    return PoolLag(pool, topic, group, lags, read_at, positions, sum(ends.values()))


def pool_state(lag: PoolLag, heartbeats: Sequence[Heartbeat], now: float, held: int = 0) -> PoolState:
    """What admission control needs to know of a pool: its backlog and its workers by state."""
    states = Counter(hb.state for hb in heartbeats if now - hb.sent_at <= hb.ttl_ms / 1000)
    return PoolState(
        pool=lag.pool,
        lag=lag.total,
        held=held,
        ready=states[WorkerState.READY],
        starting=states[WorkerState.STARTING],
        draining=states[WorkerState.DRAINING],
        updated_at=now,
    )


def pool_state_ttl_ms(tick_s: float) -> int:
    """How long the scaler keeps a PoolState it wrote: three ticks, and longer than readers count it fresh,
    so a round slower than its tick (many pools, a loaded host) leaves no gap in which the key is gone
    while the state it held would still be current."""
    return int(max(3 * tick_s, POOL_STATE_STALE_S + tick_s) * 1000)
