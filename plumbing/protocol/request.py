"""One request's life in Redis: claiming it for a worker, starting it there, writing its chunks, and
cancelling a stored response. Every key is in the request's hash slot."""

from __future__ import annotations

from enum import StrEnum

from redis.asyncio.client import Pipeline

from plumbing.replay import MOVES_FIELD, log_field, log_field_lua, parse_moves
from queue_schemas.codec import encode
from queue_schemas.messages import CancelNotice, StreamEvent
from queue_schemas.names import Names

CANCEL_MARK_TTL_MS = 10 * 60 * 1000  # a cancelled mark outlives any request's wait for a worker


class Placed(StrEnum):
    """What PLACE_SCRIPT found."""

    PLACED = "placed"  # claimed for the worker
    OWNED = "owned"  # claimed before by a worker that has neither started nor answered it
    DUPLICATE = "duplicate"  # served already (see `served_already`)
    CANCELLED = "cancelled"
    CHANGED = "changed"  # a move whose replay log grew since it was read


class Begun(StrEnum):
    """What BEGIN_SCRIPT found."""

    OK = "ok"
    CANCELLED = "cancelled"
    MOVED = "moved"  # placed on another worker while this one was presumed dead


class ResponseCancel(StrEnum):
    """What CANCEL_SCRIPT did to a stored response's request."""

    ENDED = "ended"  # it had not started: its stream was ended here
    RUNNING = "running"  # its worker ends it on the cancelled mark


def served_already(
    owner: bytes | str | None, started: bytes | str | None, answered: bytes | str | None
) -> bool:
    """Whether a request needs nothing more, by its marks: answered, or started by the worker holding its
    claim. A claim alone is not enough: a dispatcher that died between claiming and appending to the
    worker's inbox left a request nobody runs. `served_already_lua` is the same rule inside a script."""
    return answered is not None or (owner is not None and _text(started) == _text(owner))


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def served_already_lua(owner: str, started: str, answered: str) -> str:
    """`served_already` as a Lua condition, given the owner's value and the keys of the two marks."""
    return f"(({owner} and redis.call('GET', {started}) == {owner}) or redis.call('EXISTS', {answered}) == 1)"


def epoch_lua(log_key: str) -> str:
    """A Lua expression: the epoch the request whose log is `log_key` has reached (its moves counted)."""
    return (
        f"(function() local n = 0 for _ in string.gmatch(redis.call('HGET', {log_key}, '{MOVES_FIELD}') "
        "or '', '[^,]+') do n = n + 1 end return n end)()"
    )


def fenced_out_lua(placement: str, writer: str) -> str:
    """A Lua condition: the request's placement names a worker other than `writer`, so `writer` may no
    longer start it or write its stream (the owner fence)."""
    return f"(function() local o = redis.call('GET', {placement}) return o and o ~= {writer} end)()"


# KEYS: placement record, cancelled mark, replay log, started mark, answered mark, stream channel (one
# request's slot).
# ARGV: worker id, record ttl ms, lost worker it moves from ('' if new), and for a move: how many fields
# the replay log held and which epoch it had reached when the move was decided, the seq the new epoch
# begins at, the log's ttl ms, the publish command and the MoveMark to publish.
# Claims the request for the worker: 'placed', then the dispatcher appends it to the worker's inbox (the
# worker's slot, so a second step). A move goes ahead only while the lost worker still owns the request
# and its log is as it was read ('changed' otherwise: the log is read again); it starts the next epoch
# (plumbing.replay: the seq it begins at is added to the log's moves), which fences the old worker out
# of what is read, and marks the stream so. A request already claimed by another worker that has
# neither started it nor answered it returns 'owned' and that worker: the claim may have been made by a
# dispatcher that died before the append, so the append is made again (a worker drops a request it
# already holds). A request served already (`served_already`: answered, or started by its owner) is a
# 'duplicate', unless it is being moved off that owner. Every reply ends with the epoch the request's
# worker writes under.
PLACE_SCRIPT = f"""
local epoch = {epoch_lua("KEYS[3]")}
if redis.call('EXISTS', KEYS[2]) == 1 then return {{'cancelled', '', epoch}} end
local owner = redis.call('GET', KEYS[1])
if ARGV[3] == '' or owner ~= ARGV[3] then
  if {served_already_lua("owner", "KEYS[4]", "KEYS[5]")} then return {{'duplicate', owner or '', epoch}} end
  if owner then return {{'owned', owner, epoch}} end
end
if ARGV[3] ~= '' then
  if redis.call('HLEN', KEYS[3]) ~= tonumber(ARGV[4]) or epoch ~= tonumber(ARGV[5]) then
    return {{'changed', '', epoch}}
  end
  local moves = redis.call('HGET', KEYS[3], '{MOVES_FIELD}')
  redis.call('HSET', KEYS[3], '{MOVES_FIELD}', moves and (moves .. ',' .. ARGV[6]) or ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[7])
  redis.call(ARGV[8], KEYS[6], ARGV[9])
  epoch = epoch + 1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {{'placed', ARGV[1], epoch}}
"""


def place_keys(names: Names, request_id: str) -> list[str]:
    """KEYS of PLACE_SCRIPT."""
    return [
        names.placement(request_id),
        names.cancelled(request_id),
        names.replay(request_id),
        names.started(request_id),
        names.answered(request_id),
        names.stream_channel(request_id),
    ]


# KEYS: cancelled mark, placement record, started mark, replay log, stream channel (one request's slot).
# ARGV: this worker's id, mark ttl ms, and optionally the publish command (PUBLISH or SPUBLISH), the
# first chunk, its log field (plumbing.replay.log_field) and the log's ttl ms.
# Marks the request started unless it was cancelled, or re-placed on another worker while this one was
# presumed dead (the dispatcher moves a request only once its owner is gone). The first chunk goes out,
# and into the replay log, in the same step, so a request that may not start here publishes nothing,
# and starting costs no round trip of its own.
BEGIN_SCRIPT = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 'cancelled' end
if {fenced_out_lua("KEYS[2]", "ARGV[1]")} then return 'moved' end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
if ARGV[3] then
  redis.call('HSET', KEYS[4], ARGV[5], ARGV[4])
  redis.call('PEXPIRE', KEYS[4], ARGV[6])
  redis.call(ARGV[3], KEYS[5], ARGV[4])
end
return 'ok'
"""


def begin_keys(names: Names, request_id: str) -> list[str]:
    """KEYS of BEGIN_SCRIPT."""
    return [
        names.cancelled(request_id),
        names.placement(request_id),
        names.started(request_id),
        names.replay(request_id),
        names.stream_channel(request_id),
    ]


def chunk_commands(
    names: Names,
    chunk: StreamEvent,
    payload: bytes,
    epoch: int,
    ttl_ms: int,
    publish: str,
    check: bool = True,
) -> list[tuple[str | bytes | int, ...]]:
    """What a worker sends for one chunk of its request, pipelined (no script): the chunk into the
    replay log under its epoch's field and the publish on the stream channel (`publish` is PUBLISH or
    SPUBLISH; '' logs without publishing, as for a batch request's progress); with `check`, the log's
    expiry and then a read of the log's moves, last, which says whether the request is still at the
    writer's epoch (`still_owner`). A worker checks a request's first chunk and then about once a
    `CHECK_EVERY_S` (`check_due`): a log deleted or lost under a running request gets its expiry back
    within that, and a worker moved off learns it within that (what it writes meanwhile is never read,
    and its end cannot be written: a terminal chunk goes through END_SCRIPT, `end_args`). Every key is
    in the request's hash slot."""
    rid = chunk.request_id
    log_key = names.replay(rid)
    commands: list[tuple[str | bytes | int, ...]] = [("HSET", log_key, log_field(epoch, chunk.seq), payload)]
    if publish:
        commands.append((publish, names.stream_channel(rid), payload))
    if check:
        commands += [("PEXPIRE", log_key, ttl_ms), ("HGET", log_key, MOVES_FIELD)]
    return commands


CHECK_EVERY_S = 1.0


def check_due(last_checked: float | None, now: float) -> bool:
    """Whether a worker's next chunk of a request checks the log's expiry and moves (`chunk_commands`):
    its first, then one about every CHECK_EVERY_S (monotonic seconds). Pure."""
    return last_checked is None or now - last_checked >= CHECK_EVERY_S


def still_owner(moves: bytes | str | None, epoch: int) -> bool:
    """Whether a request is still at a writer's `epoch`, by the log's moves as read after its write: a
    move since means another worker writes it now. `epoch_lua` counts the same in a script."""
    return len(parse_moves(moves)) == epoch


# KEYS: replay log, stream channel (one request's slot). ARGV: the writer's epoch, the chunk's log field,
# the chunk, log ttl ms, the publish command ('' to log only).
# A worker's terminal chunk (final or error): written only while the request is at the writer's epoch,
# so a worker the request moved off can neither end its stream nor cut its log's life short. Returns
# 1, or 0 when the request has moved (nothing is written).
END_SCRIPT = f"""
if {epoch_lua("KEYS[1]")} ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if ARGV[5] ~= '' then redis.call(ARGV[5], KEYS[2], ARGV[3]) end
return 1
"""


def end_args(
    names: Names, chunk: StreamEvent, payload: bytes, epoch: int, ttl_ms: int, publish: str
) -> tuple[list[str], list[str | bytes | int]]:
    """KEYS and ARGV of END_SCRIPT for a worker's terminal chunk."""
    rid = chunk.request_id
    keys = [names.replay(rid), names.stream_channel(rid)]
    return keys, [epoch, log_field(epoch, chunk.seq), payload, ttl_ms, publish]


# KEYS: replay log, stream channel (one request's slot). ARGV: seq, the chunk (an ErrorChunk with no
# epoch: the control plane's), log ttl ms, the publish command.
# A dispatcher's chunk (its error for a request it answers), logged under the epoch the request has
# reached and published.
CONTROL_CHUNK_SCRIPT = f"""
local field = {log_field_lua(epoch_lua("KEYS[1]"), "ARGV[1]")}
redis.call('HSET', KEYS[1], field, ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call(ARGV[4], KEYS[2], ARGV[2])
return 1
"""


def control_chunk_args(
    names: Names, chunk: StreamEvent, payload: bytes, ttl_ms: int, publish: str
) -> tuple[list[str], list[str | bytes | int]]:
    """KEYS and ARGV of CONTROL_CHUNK_SCRIPT for one chunk."""
    rid = chunk.request_id
    keys = [names.replay(rid), names.stream_channel(rid)]
    return keys, [chunk.seq, payload, ttl_ms, publish]


# KEYS: response record, cancelled mark, started mark, replay log, stream channel (one request's slot).
# ARGV: cancel mark ttl ms, the cancelled error chunk (seq 0, no epoch: the control plane's), its log
# ttl ms, the publish command, now.
# Returns 'ended' when the request had not started and its log holds no chunk (its moves aside): its
# stream is ended here, under the epoch it has reached; else 'running'.
CANCEL_SCRIPT = f"""
redis.call('HSETNX', KEYS[1], 'cancelled', ARGV[5])
redis.call('SET', KEYS[2], 'response cancelled', 'PX', ARGV[1])
local chunks = redis.call('HLEN', KEYS[4]) - redis.call('HEXISTS', KEYS[4], '{MOVES_FIELD}')
if redis.call('EXISTS', KEYS[3]) == 0 and chunks == 0 then
  redis.call('HSET', KEYS[4], {log_field_lua(epoch_lua("KEYS[4]"), "0")}, ARGV[2])
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
  redis.call(ARGV[4], KEYS[5], ARGV[2])
  return 'ended'
end
return 'running'
"""


def cancel_keys(names: Names, request_id: str) -> list[str]:
    """KEYS of CANCEL_SCRIPT."""
    return [
        names.response(request_id), names.cancelled(request_id), names.started(request_id),
        names.replay(request_id), names.stream_channel(request_id),
    ]  # fmt: skip


def cancel(pipe: Pipeline, names: Names, request_id: str, reason: str, now: float) -> None:
    """Queue on `pipe` what cancels a request wherever it is: its cancelled mark (read by the placement
    and start scripts, so it never starts later) and a notice on the cancel channel (for a dispatcher
    holding it or a worker running it). The one writer of the mark beside CANCEL_SCRIPT."""
    notice = CancelNotice(request_id=request_id, reason=reason, sent_at=now)
    pipe.set(names.cancelled(request_id), reason, px=CANCEL_MARK_TTL_MS)
    pipe.execute_command("PUBLISH", names.cancel_channel(), encode(notice))  # see plumbing/publisher.py
