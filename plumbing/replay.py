"""A request's replay log: every chunk published for it, by sequence number, kept in Redis.

The log is written by the same script as the PUBLISH, so it holds exactly what was published, and it
is what the rest of the system trusts about a stream:
- the ingress reads it to fill a gap (chunks published while its pub/sub connection was down, or
  before a Redis restart it was disconnected through);
- the dispatcher reads it to move a request off a lost worker: the tokens delivered so far become part
  of the prompt on another worker (dispatcher.migration).

Writes are fenced by epoch rather than checked one by one. A request's worker writes under the
request's writer epoch (InferenceRequest.epoch: 0 where it was first placed), its chunk `seq` under
the field `log_field(epoch, seq)`, with plain pipelined commands. Each move off a lost worker starts
the next epoch in the same step as the claim (PLACE_SCRIPT): it appends the epoch's first sequence
number to the log's own MOVES_FIELD (so the moves live and expire with the log, and one HGETALL reads
both) and publishes a MoveMark on the stream channel. A reader takes chunk `seq` from the newest epoch
that had begun by it (`epoch_of`), so whatever a lost worker still writes is never read; the ingress
drops a live chunk of an older epoch than the one that owns its seq (ingress.relay); the lost worker
learns it was moved from the moves it reads back with each write (`still_owner`), and its terminal
chunk is written by a script that checks its epoch first, so it can neither end a stream nor shorten
the log's life. The control plane (a dispatcher's error, a cancel) writes under the epoch the request
has reached.

The log lives while the request can still run and for LOG_AFTER_END_MS after its terminal chunk; a
stored response's log (InferenceRequest.keep_log_s) until that long past the request's deadline. Every
write sets its expiry again, so a log deleted or lost mid-stream never comes back without one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from queue_schemas.codec import decode_stream_event
from queue_schemas.errors import SchemaError
from queue_schemas.messages import ErrorChunk, FinalChunk, StreamEvent, TokenChunk
from queue_schemas.names import Names

LOG_AFTER_END_MS = 120_000
MIN_LOG_TTL_MS = 60_000


def log_ttl_ms(deadline: float, now: float, terminal: bool, keep_s: int = 0) -> int:
    """How long the log is kept after this write: past the request's deadline while it runs (it may
    still move), a couple of minutes once it has ended (for an ingress catching up). A stored response's
    log (`keep_s` > 0) is kept until `keep_s` past the deadline, running or ended: the response record
    beside it expires then too."""
    if keep_s > 0:
        return max(MIN_LOG_TTL_MS, int((deadline - now + keep_s) * 1000))
    if terminal:
        return LOG_AFTER_END_MS
    return max(MIN_LOG_TTL_MS, int((deadline - now) * 1000) + LOG_AFTER_END_MS)


MOVES_FIELD = "m"  # the log's field of the first seqs of epochs 1, 2, ..., comma-separated


def parse_moves(value: bytes | str | None) -> tuple[int, ...]:
    """The first seqs of epochs 1, 2, ... from the log's MOVES_FIELD; none if it is missing or unreadable
    (only the move script writes it)."""
    text = value.decode() if isinstance(value, bytes) else (value or "")
    try:
        return tuple(int(point) for point in text.split(",") if point)
    except ValueError:
        return ()


def log_field(epoch: int, seq: int) -> str:
    """The log field chunk `seq` is written under by a writer of `epoch`: the seq alone at epoch 0 (a
    request never moved), so most logs carry no epoch at all. `log_field_lua` is the same in a script."""
    return str(seq) if epoch == 0 else f"{seq}.{epoch}"


def log_field_lua(epoch: str, seq: str) -> str:
    """`log_field` as a Lua expression over two expressions (numbers or numeric strings)."""
    return f"(tonumber({epoch}) == 0 and tostring({seq}) or (tostring({seq}) .. '.' .. tostring({epoch})))"


def epoch_of(moves: Sequence[int], seq: int) -> int:
    """The epoch whose chunk `seq` is read: the newest that had begun by `seq`. `moves` are the first
    seqs of epochs 1, 2, ... in order (non-decreasing: a move starts where the log was)."""
    return bisect_right(moves, seq)


def in_order(raw: dict[bytes, bytes], from_seq: int = 0, moves: Sequence[int] = ()) -> list[StreamEvent]:
    """The logged chunks from `from_seq` on, in order, each from the epoch that owns it, up to the first
    one missing or unreadable; none after a terminal chunk."""
    found: list[StreamEvent] = []
    seq = from_seq
    while (payload := raw.get(log_field(epoch_of(moves, seq), seq).encode())) is not None:
        try:
            event = decode_stream_event(payload)
        except SchemaError:
            break
        found.append(event)
        if not isinstance(event, TokenChunk):
            break
        seq += 1
    return found


@dataclass(frozen=True, slots=True)
class LogState:
    """A request's log as read in one step: its chunks in order, how many fields the log holds (every
    epoch's, read or not, and its moves), and the first seqs of its epochs after the first."""

    events: list[StreamEvent]
    fields: int
    moves: tuple[int, ...]

    @property
    def epoch(self) -> int:
        """The epoch the request has reached."""
        return len(self.moves)


async def read_log_state(redis: aioredis.Redis, names: Names, request_id: str, from_seq: int = 0) -> LogState:
    """The request's log from `from_seq` on and its epochs, read in one step."""
    raw = await redis.hgetall(names.replay(request_id))
    fields = {_as_bytes(k): _as_bytes(v) for k, v in raw.items()}
    moves = parse_moves(fields.get(MOVES_FIELD.encode()))
    return LogState(in_order(fields, from_seq, moves), len(fields), moves)


async def read_log(
    redis: aioredis.Redis, names: Names, request_id: str, from_seq: int = 0
) -> list[StreamEvent]:
    """The request's chunks from `from_seq` on, in order, as far as the log is unbroken."""
    return (await read_log_state(redis, names, request_id, from_seq)).events


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def is_terminal(event: StreamEvent) -> bool:
    return isinstance(event, FinalChunk | ErrorChunk)
