import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from gpu_workers.engine import EarlyStart, EngineError, EngineOutput, EngineStats
from gpu_workers.presence import Ready, batch_slots, engine_load, next_light, next_to_start, under_share
from gpu_workers.starting import start_refusal
from queue_schemas.messages import FinishReason, InferenceRequest, Priority, SamplingParams


def request(**fields: object) -> InferenceRequest:
    base: dict[str, object] = {
        "request_id": "r" * 16, "pool": "p", "model": "m", "team": "t", "prompt_token_ids": (1,),
        "sampling": SamplingParams(max_tokens=1), "created_at": 0.0, "start_by": 10.0, "deadline": 20.0,
    }  # fmt: skip
    base.update(fields)
    return InferenceRequest.model_validate(base)


def test_start_refusals() -> None:
    assert start_refusal(request(), now=5.0) is None
    assert start_refusal(request(), now=11.0) == (
        "timeout",
        "no engine could start the request before its queue deadline",
    )


def test_process_start_time_is_when_the_process_started() -> None:
    """A child process reads its own start time two seconds after it began: the answer is when it was
    spawned (to the second: the kernel's boot time is whole seconds), not when it asked."""
    code = (
        "import time; time.sleep(2.0); from gpu_workers.starting import process_started_at as p; print(p())"
    )
    spawned = time.time()
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    started = float(child.stdout)
    assert spawned - 1.05 <= started <= spawned + 1.0, (started - spawned, child.stderr)


class Stream:
    """An engine stream that records what happened to it."""

    def __init__(self, outputs: list[EngineOutput], fail_first: bool = False) -> None:
        self.outputs = outputs
        self.fail_first = fail_first
        self.prefill_started = asyncio.Event()
        self.release = asyncio.Event()
        self.aborted = False

    async def run(self) -> AsyncIterator[EngineOutput]:
        try:
            self.prefill_started.set()
            await self.release.wait()
            if self.fail_first:
                raise EngineError("prefill failed")
            for out in self.outputs:
                yield out
        except asyncio.CancelledError:
            self.aborted = True
            raise


async def test_early_start_runs_prefill_before_it_is_iterated_and_yields_everything_in_order() -> None:
    last = EngineOutput("c", 1, finish_reason=FinishReason.STOP)
    outputs = [EngineOutput("a", 1), EngineOutput("b", 1), last]
    stream = Stream(outputs)
    pieces = EarlyStart(stream.run())
    await asyncio.wait_for(stream.prefill_started.wait(), 1)  # under way with nobody iterating yet
    stream.release.set()
    assert [out async for out in pieces] == outputs
    await pieces.discard()  # a finished stream: nothing to abort
    assert not stream.aborted


async def test_discarding_an_early_start_aborts_it_and_drops_its_error() -> None:
    stream = Stream([EngineOutput("a", 1)])
    pieces = EarlyStart(stream.run())
    await asyncio.wait_for(stream.prefill_started.wait(), 1)
    await pieces.discard()
    assert stream.aborted

    failing = Stream([], fail_first=True)
    failing.release.set()
    pieces = EarlyStart(failing.run())
    await asyncio.sleep(0)
    await pieces.discard()  # the engine's error is not raised for a stream nobody will read


async def test_an_early_start_error_surfaces_when_iterated() -> None:
    failing = Stream([], fail_first=True)
    failing.release.set()
    pieces = EarlyStart(failing.run())
    with pytest.raises(EngineError, match="prefill failed"):
        await anext(pieces)


def test_the_heartbeat_counts_what_the_engine_was_handed_before_its_statistics_show_it() -> None:
    stats = EngineStats(
        kv_blocks_total=10, kv_blocks_free=10, block_size=16, running=5, waiting=1, decode_tokens_per_s=0.0
    )
    assert engine_load(stats, handed=8).running == 7  # 8 handed, 1 reported waiting
    assert engine_load(stats, handed=4).running == 5  # the engine's own figure when it is higher
    assert engine_load(stats, handed=8).waiting == 1


def ready(rid: str, team: str, priority: Priority = Priority.INTERACTIVE, tag: int = 0, at: int = 0) -> Ready:
    request = InferenceRequest(
        request_id=rid * 8, pool="p", model="m", team=team, prompt_token_ids=(1,),
        sampling=SamplingParams(max_tokens=1), priority=priority, fair_tag=tag, created_at=0.0, deadline=1.0,
    )  # fmt: skip
    return Ready(request, b"0-1", at)


def test_a_free_slot_takes_the_band_then_the_team_with_least_running_here_then_the_fair_tag() -> None:
    queued = [
        ready("b", "late", Priority.BATCH, at=0),
        ready("a", "flood", tag=100, at=1),
        ready("q", "quiet", tag=900, at=2),
        ready("c", "flood", tag=50, at=3),
    ]
    # flood holds 7 of this worker's slots, quiet none: quiet's request first, whatever the tags.
    assert next_to_start(queued, {"flood": 7}) == 2
    # Nobody running here: the lowest fair tag, then the order read.
    assert next_to_start(queued, {}) == 3
    # Batch only when no interactive request is ready, and only while batch has room on the worker.
    assert next_to_start([queued[0]], {}) == 0
    assert next_to_start([queued[0]], {}, batch_room=False) is None
    assert next_to_start(queued, {}, batch_room=False) == 3


def test_batch_holds_what_the_headroom_leaves_of_the_slots_and_at_least_one() -> None:
    assert batch_slots(8, 0.25) == 6
    assert batch_slots(8, 0.875) == 1
    assert batch_slots(1, 0.5) == 1
    assert batch_slots(64, 0.0) == 64


def test_a_team_is_under_its_share_below_an_equal_split_among_the_teams_running_here() -> None:
    assert under_share("b", {"a": 7}, slots=8)  # b would be the second team: its share is 4
    assert under_share("a", {"a": 7}, slots=8)  # alone, a's share is all 8 slots
    assert not under_share("a", {"a": 8}, slots=8)  # so a team alone never takes a light slot
    assert under_share("a", {"a": 3, "b": 1}, slots=8)
    assert not under_share("a", {"a": 4, "b": 1}, slots=8)
    assert under_share("c", {"a": 1, "b": 1}, slots=2)  # a team running nothing here is always under
    assert not under_share("a", {"a": 1, "b": 1}, slots=2)


def test_a_light_slot_takes_only_an_interactive_request_of_a_team_under_its_share() -> None:
    queued = [
        ready("a", "flood", tag=1, at=0),
        ready("b", "quiet", Priority.BATCH, at=1),
        ready("q", "quiet", tag=900, at=2),
    ]
    chosen = next_light(queued, {"flood": 8}, slots=8)
    assert chosen is not None
    assert queued[chosen].request.request_id == "q" * 8
    assert next_light(queued[:2], {"flood": 8}, slots=8) is None  # flood is over its share, quiet's is batch
    assert next_light(queued, {"flood": 4, "quiet": 4}, slots=8) is None  # both hold their equal share
