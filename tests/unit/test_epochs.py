"""Writer epochs (plumbing.replay): a request moved off a lost worker is read, and relayed, from the epoch
that owns each sequence number, so what the lost worker still writes never reaches a client."""

from __future__ import annotations

import time
from typing import cast

from dispatcher.intake import as_received
from ingress.relay import EpochFence, events
from ingress.streams import RESYNC, StreamHub, Subscription
from plumbing.protocol.request import CHECK_EVERY_S, check_due, chunk_commands
from plumbing.replay import LogState, epoch_of, in_order, log_field, parse_moves
from queue_schemas.codec import encode
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    FinishReason,
    MoveMark,
    PlacementNote,
    Resume,
    StreamEvent,
    TokenChunk,
    Usage,
)
from queue_schemas.names import Names
from tests.integration.helpers import make_request

RID = "0123456789abcdef" * 2


class Streamed:
    request_id = RID
    deadline = time.time() + 60


def token(seq: int, epoch: int, text: str = "") -> TokenChunk:
    return TokenChunk(
        request_id=RID, seq=seq, text=text or f"e{epoch}s{seq}", num_tokens=1, token_ids=(seq,), epoch=epoch
    )


def final(seq: int, epoch: int) -> FinalChunk:
    usage = Usage(prompt_tokens=1, completion_tokens=seq + 1)
    return FinalChunk(
        request_id=RID, seq=seq, finish_reason=FinishReason.STOP, usage=usage, worker_id="w", epoch=epoch
    )


def test_a_chunk_of_epoch_0_is_logged_and_sent_as_before_epochs() -> None:
    assert log_field(0, 7) == "7"
    assert log_field(2, 7) == "7.2"
    plain = TokenChunk(request_id=RID, seq=1, text="a", num_tokens=1, token_ids=(1,))
    assert b"epoch" not in encode(plain)
    assert b'"epoch":2' in encode(token(1, 2))
    assert b"epoch" not in encode(ErrorChunk(request_id=RID, seq=0, code="timeout", message="m"))
    assert b'"epoch":0' in encode(ErrorChunk(request_id=RID, seq=0, code="timeout", message="m", epoch=0))


def test_moves_read_from_the_log() -> None:
    assert parse_moves(b"3,3,7") == (3, 3, 7)
    assert parse_moves(None) == ()
    assert parse_moves(b"x,1") == (), "unreadable: as if never moved"
    assert epoch_of((3, 3, 7), 3) == 2, "two moves at one seq: the later owns it"
    assert epoch_of((0,), 0) == 1, "a restart before any chunk"


def test_the_log_is_read_from_the_epoch_that_owns_each_seq() -> None:
    # Epoch 0 wrote 0-2 and, lost but still running, 3 and 4; epoch 1 began at 3 and ended at 4; a
    # restart of epoch 1 at 4 (epoch 2, nothing written yet) would end the log at 4.
    written: list[TokenChunk | FinalChunk] = [token(0, 0), token(1, 0), token(2, 0), token(3, 0)]
    written += [token(4, 0), token(3, 1), final(4, 1)]
    raw = {log_field(c.epoch, c.seq).encode(): encode(c) for c in written}
    got = in_order(raw, 0, (3,))
    assert [(c.seq, c.epoch) for c in got] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
    assert isinstance(got[-1], FinalChunk)
    assert [(c.seq, c.epoch) for c in in_order(raw, 2, (3,))] == [(2, 0), (3, 1), (4, 1)]
    assert [c.seq for c in in_order(raw, 0, (3, 4))] == [0, 1, 2, 3], "epoch 2 has not written seq 4"
    assert [c.seq for c in in_order(raw, 0, ())] == [0, 1, 2, 3, 4], "unmoved: epoch 0's, as before"


async def relayed(
    messages: list[bytes], logged: list[StreamEvent] | None = None, moves: tuple[int, ...] = ()
) -> list[StreamEvent]:
    sub = Subscription(cast(StreamHub, None), b"ch")
    for message in messages:
        sub.deliver(message)
    reads = 0

    async def read_log(request_id: str, from_seq: int) -> LogState:
        nonlocal reads
        reads += 1
        assert reads < 10, "the relay reads the log again and again"
        raw = {log_field(c.epoch or 0, c.seq).encode(): encode(c) for c in logged or []}
        return LogState(in_order(raw, from_seq, moves), len(raw), moves)

    return [event async for event in events(sub, Streamed(), read_log)]


async def test_the_relay_drops_a_lost_workers_chunks_once_the_request_moved() -> None:
    mark = MoveMark(request_id=RID, epoch=1, seq=2)
    zombie_error = ErrorChunk(request_id=RID, seq=2, code="engine_error", message="lost", epoch=0)
    messages = [token(0, 0), token(1, 0), mark, token(2, 0), zombie_error, token(2, 1), final(3, 1)]
    got = await relayed([encode(m) for m in messages])
    assert [(c.seq, c.epoch) for c in got] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert isinstance(got[-1], FinalChunk)


async def test_a_newer_epochs_chunk_fences_the_older_one_without_its_mark() -> None:
    # The mark was missed (the chunk of the newer epoch came first): the older epoch's late chunk at a
    # seq the newer one owns is dropped all the same.
    got = await relayed([encode(m) for m in (token(0, 0), token(1, 1), token(2, 0), final(2, 1))])
    assert [(c.seq, c.epoch) for c in got] == [(0, 0), (1, 1), (2, 1)]


async def test_the_old_epochs_chunks_below_the_move_still_come_from_the_log() -> None:
    # The lost worker logged seq 1 but its publish never went out; the move began epoch 1 at seq 2. The
    # relay sees epoch 1's chunk first, reads the log for seq 1 (epoch 0's, and rightly so) and goes on.
    logged: list[StreamEvent] = [token(0, 0), token(1, 0), token(2, 1), final(3, 1)]
    mark = MoveMark(request_id=RID, epoch=1, seq=2)
    got = await relayed([encode(m) for m in (token(0, 0), mark, token(2, 1), final(3, 1))], logged, (2,))
    assert [(c.seq, c.epoch) for c in got] == [(0, 0), (1, 0), (2, 1), (3, 1)]


async def test_after_a_reconnect_the_moves_in_the_log_fence_the_lost_worker() -> None:
    # The mark went out while the relay was disconnected; the log read on RESYNC shows the move, so the
    # lost worker's late end (it had not yet learned it was moved) never reaches the client.
    logged: list[StreamEvent] = [token(0, 0), token(1, 0)]
    late = ErrorChunk(request_id=RID, seq=2, code="engine_error", message="lost", epoch=0)
    got = await relayed(
        [encode(token(0, 0)), RESYNC, encode(late), encode(token(2, 1)), encode(final(3, 1))], logged, (2,)
    )
    assert [(c.seq, c.epoch) for c in got] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_the_fence_knows_the_owner_of_each_seq() -> None:
    fence = EpochFence()
    assert not fence.stale(token(5, 0)), "never moved"
    fence.learn((3, 6))
    assert not fence.stale(token(2, 0)), "below the first move: epoch 0's"
    assert fence.stale(token(3, 0))
    assert not fence.stale(token(4, 1))
    assert fence.stale(token(6, 1))
    assert not fence.stale(token(6, 2))
    assert not fence.stale(ErrorChunk(request_id=RID, seq=9, code="timeout", message="m"))


async def test_the_control_planes_error_speaks_for_any_epoch() -> None:
    mark = MoveMark(request_id=RID, epoch=3, seq=1)
    timeout = ErrorChunk(request_id=RID, seq=1, code="timeout", message="no worker in time")
    got = await relayed([encode(m) for m in (token(0, 0), mark, timeout)])
    assert got == [token(0, 0), timeout]


def test_a_record_from_a_topic_cannot_claim_what_only_a_dispatcher_sets() -> None:
    request = make_request("sim", "req-forged-0001")
    assert as_received(request) is request
    resume = Resume(prompt_tokens=1, delivered_tokens=49, next_seq=5, text="x", migrations=1, max_tokens=61)
    forged = request.model_copy(
        update={
            "epoch": 7,
            "resume": resume,
            "placement": PlacementNote(placed_at=0.0, predicted_ttft_s=0.0, uncached_tokens=0),
        }
    )
    got = as_received(forged)
    assert (got.epoch, got.resume, got.placement, got.handoff) == (0, None, None, None)
    assert got.client_prompt_tokens == 50, "its whole prompt is the client's, and charged so"


def test_a_worker_checks_a_requests_moves_and_expiry_on_its_first_write_then_about_each_second() -> None:
    assert check_due(None, 5.0)
    assert not check_due(5.0, 5.5)
    assert check_due(5.0, 5.0 + CHECK_EVERY_S)
    chunk = token(4, 1)
    plain = chunk_commands(Names(), chunk, b"x", 1, 1000, "PUBLISH", check=False)
    assert [c[0] for c in plain] == ["HSET", "PUBLISH"]
    checked = chunk_commands(Names(), chunk, b"x", 1, 1000, "PUBLISH", check=True)
    assert [c[0] for c in checked] == ["HSET", "PUBLISH", "PEXPIRE", "HGET"], "the moves are read last"
    assert checked[0][2] == "4.1"
