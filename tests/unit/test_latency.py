"""The latency model (plumbing.latency), the latency objective of placement, and what a worker reports
for it (gpu_workers.first_tokens)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from dispatcher.placement import (
    AFFINITY_REASON,
    SHED_REASON,
    SLO_REASON,
    Demand,
    PlacementPolicy,
    WorkerSnapshot,
    choose,
    latency_choice,
)
from dispatcher.placing import demand_of, placement_note
from dispatcher.table import WorkerTable, choose_over
from gpu_workers.first_tokens import FirstTokenLedger
from gpu_workers.slots import Slots
from openai_api.admission import slo_from_headers
from openai_api.errors import InvalidRequest
from plumbing.latency import Correction, backlog_now, itl_after, predicted_ttft, slot_wait_s
from queue_schemas.messages import Handoff, Heartbeat, PlacementNote, Priority, Tier, WorkerState
from tests.integration.helpers import make_request

NOW = 1000.0
POLICY = PlacementPolicy(queue_depth="fixed")
HASHES = [f"h{i}" for i in range(8)]  # 128 tokens


def beat(worker_id: str, backlog: int = 0, age: float = 0.0, **fields: object) -> Heartbeat:
    values: dict[str, object] = {
        "worker_id": worker_id, "pool": "p", "model": "m", "state": WorkerState.READY, "seq": 1,
        "sent_at": NOW - age, "ttl_ms": 3000, "kv_blocks_total": 1000, "kv_blocks_free": 1000,
        "block_size": 16, "running": 0, "waiting": 0, "inbox_pending": 0, "decode_tokens_per_s": 0.0,
        "started_at": 0.0, "prefill_backlog": backlog, "prefill_tokens_per_s": 4000.0, "step_s": 0.02,
        **fields,
    }  # fmt: skip
    return Heartbeat(**values)  # type: ignore[arg-type]


def demand(**fields: object) -> Demand:
    return Demand(prompt_tokens=128, block_hashes=HASHES, max_tokens=64, **fields)  # type: ignore[arg-type]


def test_the_predicted_ttft_is_the_step_in_progress_the_prefill_ahead_and_its_own() -> None:
    # 4,000 tokens at 4,000/s, two chunks of 2,048 (a step each), half the step in progress.
    assert float(predicted_ttft(1000, 3000, 4000.0, 0.02, 2048)) == pytest.approx(0.01 + 1.0 + 0.04)
    assert float(predicted_ttft(1000, 3000, 4000.0, 0.02, 2048, 0.5, 2.0)) == pytest.approx(2 * 1.55)
    both = predicted_ttft(np.array([10.0, 2048.0]), np.array([0.0, 0.0]), 4000.0, 0.02, 2048)
    assert both.tolist() == pytest.approx([0.01 + 10 / 4000 + 0.02, 0.01 + 2048 / 4000 + 0.02])


def test_the_reported_backlog_shrinks_by_what_the_worker_computed_since() -> None:
    per_token = 1 / 4000 + 0.02 / 2048
    assert float(backlog_now(8000, 1.0, 4000.0, 0.02, 2048)) == pytest.approx(8000 - 1 / per_token)
    assert float(backlog_now(8000, 10.0, 4000.0, 0.02, 2048)) == 0.0
    assert float(backlog_now(8000, -1.0, 4000.0, 0.02, 2048)) == 8000.0  # a clock ahead: nothing done


def test_a_slot_is_waited_for_only_beyond_the_workers_slots() -> None:
    assert float(slot_wait_s(70, 64, 10.0)) == pytest.approx(0.7)
    assert float(slot_wait_s(10, 64, 10.0)) == 0.0
    assert float(slot_wait_s(70, 0, 10.0)) == 0.0  # slots not stated
    # No completions reported yet: 64 slots each held 8 s finish 8 requests a second.
    assert float(slot_wait_s(70, 64, 0.0, 8.0)) == pytest.approx(7 / 8)


def test_a_prefill_slows_the_running_requests_by_its_time_over_their_output() -> None:
    assert float(itl_after(2560, 4000.0, 0.02, 256)) == pytest.approx(0.02 + 0.64 / 256)


def test_the_correction_follows_the_ratio_and_states_its_error() -> None:
    c = Correction()
    for _ in range(200):
        c.observe(0.1, 0.2)  # twice as slow as predicted, every time
    assert c.factor == pytest.approx(2.0, rel=1e-3)
    assert c.error < 0.01  # the corrected prediction is right
    c.observe(0.1, 100.0)  # one outlier moves the factor by at most e^0.1
    assert c.factor <= 2.0 * math.exp(0.1) + 1e-9
    before = (c.log_ratio, c.samples)
    c.observe(0.0, 1.0)  # no prediction: ignored
    c.observe(0.1, math.inf)
    assert (c.log_ratio, c.samples) == before


def test_placement_goes_where_the_first_token_is_predicted_soonest_not_where_the_prefix_is() -> None:
    cached = WorkerSnapshot(beat("cached", backlog=20_000), matched_blocks=8)  # 5 s of prefill queued
    idle = WorkerSnapshot(beat("idle"))
    for pick in (choose, choose_over):
        decision = pick([cached, idle], demand(), NOW, POLICY, random.Random(0))
        assert decision.worker_id == "idle"
        assert decision.uncached_tokens == 128
        assert decision.predicted_ttft_s == pytest.approx(0.01 + 128 / 4000 + 0.02)
    light = WorkerSnapshot(beat("cached", backlog=100), matched_blocks=8)
    for pick in (choose, choose_over):
        decision = pick([light, idle], demand(), NOW, POLICY, random.Random(0))
        assert (decision.worker_id, decision.uncached_tokens) == ("cached", 1)


def test_the_correction_in_a_heartbeat_moves_the_choice() -> None:
    slow = WorkerSnapshot(beat("slow", ttft_correction=10.0))
    busy = WorkerSnapshot(beat("busy", backlog=2000))  # 0.5 s + 0.03 s, against 10 x 0.062 s
    assert choose([slow, busy], demand(), NOW, POLICY, random.Random(0)).worker_id == "busy"


def test_placements_since_a_heartbeat_add_work_and_the_engine_computes_it_meanwhile() -> None:
    table = WorkerTable()
    table.upsert(beat("w", backlog=4000), 0, 0)
    assert table.work_at(NOW)[0] == 4000
    table.add_in_flight("w", 10, 4000, NOW + 0.5)
    per_token = 1 / 4000 + 0.02 / 2048
    assert table.work_at(NOW + 0.5)[0] == pytest.approx(4000 - 0.5 / per_token + 4000)
    assert table.work_at(NOW + 60)[0] == 0.0


def test_a_request_no_worker_can_serve_within_its_slo_is_held_then_placed_after_the_hold() -> None:
    busy = WorkerSnapshot(beat("busy", backlog=20_000))  # about 5 s
    held = choose([busy], demand(ttft_slo_s=1.0), NOW, POLICY, random.Random(0))
    assert (held.worker_id, held.reason, held.held) == (None, SLO_REASON, True)
    met = choose([busy], demand(ttft_slo_s=10.0), NOW, POLICY, random.Random(0))
    assert met.worker_id == "busy"
    late = choose([busy], demand(ttft_slo_s=1.0, waited_s=POLICY.slo_hold_s), NOW, POLICY, random.Random(0))
    assert late.worker_id == "busy"  # held long enough: it goes where it is predicted soonest
    batch = choose([busy], demand(priority=Priority.BATCH), NOW, POLICY, random.Random(0))
    assert batch.worker_id == "busy"  # batch requests have no TTFT SLO here


def test_a_sheddable_request_is_refused_rather_than_held() -> None:
    busy = WorkerSnapshot(beat("busy", backlog=20_000))
    for pick in (choose, choose_over):
        refused = pick([busy], demand(ttft_slo_s=1.0, sheddable=True), NOW, POLICY, random.Random(0))
        assert (refused.worker_id, refused.refused, refused.reason) == (None, True, SHED_REASON)
        assert not refused.held


def test_workers_that_keep_the_running_requests_itl_slo_come_first() -> None:
    ttft = np.array([0.1, 0.5])
    itl = np.array([0.2, 0.05])
    fit = np.array([True, True])
    busy = np.array([False, False])
    rng = random.Random(0)
    assert latency_choice(ttft, itl, fit, busy, demand(), POLICY, rng) == (1, "")
    # None keeps it: the lowest TTFT of all.
    assert latency_choice(ttft, np.array([0.2, 0.3]), fit, busy, demand(), POLICY, rng) == (0, "")
    # A batch request's placement does not weigh the running requests' ITL.
    assert latency_choice(ttft, itl, fit, busy, demand(priority=Priority.BATCH), POLICY, rng) == (0, "")


def test_a_request_waits_for_a_busy_worker_that_would_serve_it_sooner_by_the_spill_margin() -> None:
    ttft = np.array([0.05, 1.0])
    fit = np.array([False, True])
    busy = np.array([True, False])
    itl = np.zeros(2)
    assert latency_choice(ttft, itl, fit, busy, demand(), POLICY, random.Random(0)) == (None, AFFINITY_REASON)
    waited = demand(waited_s=POLICY.spill_after_s)
    assert latency_choice(ttft, itl, fit, busy, waited, POLICY, random.Random(0)) == (1, "")
    near = np.array([0.9, 1.0])  # sooner, but by less than the margin
    assert latency_choice(near, itl, fit, busy, demand(), POLICY, random.Random(0)) == (1, "")


def test_the_worker_reports_its_backlog_step_and_correction() -> None:
    ledger = FirstTokenLedger()
    placed = make_request("sim", "req-ledger-0001").model_copy(
        update={"placement": PlacementNote(placed_at=100.0, predicted_ttft_s=0.5, uncached_tokens=30)}
    )
    unplaced = make_request("sim", "req-ledger-0002")  # no note: its whole prompt (50 tokens)
    ledger.arrived(placed, 100.0)
    ledger.arrived(placed, 100.0)  # read again: counted once
    ledger.arrived(unplaced, 100.0)
    assert ledger.backlog(100.0) == 80
    assert ledger.backlog(500.0) == 80  # no rate measured: nothing is taken as computed
    ledger.first_token(placed.request_id, 101.0)  # observed 1 s against 0.5 s predicted
    assert ledger.backlog(101.0) == 50
    assert ledger.correction.factor == pytest.approx(2.0)
    ledger.ended(placed.request_id, 101.0)  # already out of the backlog
    ledger.ended(unplaced.request_id, 101.0)
    assert ledger.backlog(101.0) == 0
    ledger.tokens_after(0.1, 5)
    assert ledger.step_s == pytest.approx(0.02)
    ledger.tokens_after(0.1, 0)  # nothing to learn from
    assert ledger.step_s == pytest.approx(0.02)
    ledger.arrived(make_request("sim", "req-ledger-0003"), 102.0)
    ledger.tokens_after(0.5, 1)  # a step with a prefill chunk in it: not a decode step
    assert ledger.step_s == pytest.approx(0.02)


def test_the_worker_measures_its_prefill_rate_and_ages_its_backlog_by_it() -> None:
    ledger = FirstTokenLedger()
    ledger.tokens_after(0.02, 1)  # a 20 ms step
    alone = make_request("sim", "req-rate-0001").model_copy(
        update={"placement": PlacementNote(placed_at=0.0, predicted_ttft_s=1.0, uncached_tokens=4096)}
    )
    ledger.arrived(alone, 10.0)
    # 4,096 tokens in 1.07 s, of which 3.5 steps (two chunks, and one and a half) are decode steps.
    ledger.first_token(alone.request_id, 11.07)
    assert ledger.rate == pytest.approx(4096 / 1.0)
    queued = [
        make_request("sim", f"req-rate-{i:04d}").model_copy(
            update={"placement": PlacementNote(placed_at=0.0, predicted_ttft_s=1.0, uncached_tokens=2048)}
        )
        for i in range(2, 4)
    ]
    for req in queued:
        ledger.arrived(req, 20.0)
    assert ledger.backlog(20.0) == 4096
    assert ledger.backlog(20.5) == 4096 - 2048  # half a second at 4,096 tokens/s
    assert ledger.backlog(30.0) == 0
    # The first found nothing ahead: 2,048 tokens in 0.55 s less 2.5 steps measure 4,096 tokens/s again.
    ledger.first_token(queued[0].request_id, 20.55)
    assert ledger.rate == pytest.approx(4096)
    assert ledger.backlog(20.55) == 4096 - round(0.55 * 4096)
    # The second found work ahead of it: its time does not measure the rate.
    ledger.first_token(queued[1].request_id, 21.5)
    assert ledger.rate == pytest.approx(4096)
    assert ledger.backlog(21.5) == 0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [({}, (None, None)), ({"x-slo-ttft-ms": "500"}, (500, None)), ({"x-slo-tpot-ms": " 40 "}, (None, 40))],
)
def test_slo_headers_are_read(headers: dict[str, str], expected: tuple[int | None, int | None]) -> None:
    slo = slo_from_headers(headers)
    assert (slo.ttft_ms, slo.tpot_ms) == expected


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1e3", "2.5", "600001", "\u0661\u0662", "", "9" * 5000])
def test_a_bad_slo_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        slo_from_headers({"x-slo-ttft-ms": value})
    assert caught.value.param == "x-slo-ttft-ms"


def test_only_a_flex_interactive_request_not_yet_started_may_be_shed() -> None:
    req = make_request("sim", "req-demand-0001").model_copy(
        update={"tier": Tier.FLEX, "ttft_slo_ms": 250, "tpot_slo_ms": 40}
    )
    d = demand_of(req, 1.5, light=True, first_try=True)
    assert (d.sheddable, d.ttft_slo_s, d.tpot_slo_s, d.waited_s, d.light) == (True, 0.25, 0.04, 1.5, True)
    taken_over = demand_of(req, 0, light=True, first_try=False)  # from a lost worker: never held or shed
    assert (taken_over.sheddable, taken_over.ttft_slo_s) == (False, math.inf)
    default = req.model_copy(update={"tier": Tier.DEFAULT})
    assert not demand_of(default, 0, light=True, first_try=True).sheddable
    batch = req.model_copy(update={"priority": Priority.BATCH})
    assert not demand_of(batch, 0, light=True, first_try=True).sheddable
    assert not demand_of(batch, 0, light=True, first_try=True).light


def test_the_note_caps_a_prediction_past_a_day_and_is_absent_without_one() -> None:
    table_free = WorkerSnapshot(beat("w"))
    decision = choose([table_free], demand(), NOW, POLICY, random.Random(0))
    note = placement_note(decision, NOW)
    assert note is not None
    assert note.uncached_tokens == 128
    scored = choose([table_free], demand(), NOW, PlacementPolicy(objective="score"), random.Random(0))
    assert placement_note(scored, NOW) is None
    huge = placement_note(replace(decision, predicted_ttft_s=1e9), NOW)
    assert huge is not None
    assert huge.predicted_ttft_s == 86_400.0


def test_a_request_too_long_for_its_slo_even_on_an_idle_worker_is_placed_at_once() -> None:
    # 128 tokens take 0.06 s on an empty worker: a 10 ms SLO cannot be met by waiting for a queue.
    busy = WorkerSnapshot(beat("busy", backlog=20_000))
    for sheddable in (False, True):
        asked = demand(ttft_slo_s=0.01, sheddable=sheddable)
        for pick in (choose, choose_over):
            decision = pick([busy], asked, NOW, POLICY, random.Random(0))
            assert (decision.worker_id, decision.refused) == ("busy", False)


def test_an_adapter_request_stays_where_its_adapter_can_start_while_one_meets_its_slo() -> None:
    blocked = WorkerSnapshot(beat("blocked", adapter_slots=2, adapters_in_use=2, adapters=("a", "b")))
    holder = WorkerSnapshot(
        beat("holder", backlog=2000, adapter_slots=2, adapters_in_use=2, adapters=("x", "b"))
    )
    room = WorkerSnapshot(beat("room", backlog=4000, adapter_slots=2, adapters_in_use=1, adapters=("a",)))
    asked = demand(adapter="x")
    for pick in (choose, choose_over):
        # The idle worker would be soonest by the model, but its adapter slots are taken: the holder.
        assert pick([blocked, holder], asked, NOW, POLICY, random.Random(0)).worker_id == "holder"
        # A worker with an adapter slot free counts as able to start it.
        assert pick([blocked, room], asked, NOW, POLICY, random.Random(0)).worker_id == "room"
        # Where none that can start it meets the SLO, the model's choice stands.
        late = WorkerSnapshot(
            beat("holder", backlog=40_000, adapter_slots=2, adapters_in_use=2, adapters=("x",))
        )
        assert pick([blocked, late], asked, NOW, POLICY, random.Random(0)).worker_id == "blocked"


def test_the_worker_counts_the_adapters_its_running_requests_use() -> None:
    slots = Slots(4, 0, 4)
    requests = [
        make_request("sim", f"req-adapter-{i:04d}").model_copy(update={"adapter": name})
        for i, name in enumerate(["a", "a", "b"])
    ]
    for req in requests:
        slots.started(req)
    assert slots.adapters_in_use() == 2
    slots.ended(requests[0].request_id)
    assert slots.adapters_in_use() == 2  # "a" still runs
    slots.ended(requests[1].request_id)
    assert slots.adapters_in_use() == 1


def test_a_request_that_waited_for_a_slot_or_was_split_does_not_mislead_the_ledger() -> None:
    ledger = FirstTokenLedger()
    note = PlacementNote(placed_at=0.0, predicted_ttft_s=1.0, uncached_tokens=4096)
    waited = make_request("sim", "req-slot-0001").model_copy(update={"placement": note})
    ledger.arrived(waited, 10.0)
    ledger.started(waited.request_id, 15.0)  # five seconds for a slot, then its prefill
    ledger.first_token(waited.request_id, 16.0)
    assert ledger.rate == 0.0  # 4,096 tokens in 6 s would have read 683 tokens/s
    handoff = Handoff(id="a" * 32, prefill_worker="p0", wait_s=10)
    split = make_request("sim", "req-split-0001").model_copy(update={"placement": note, "handoff": handoff})
    ledger.arrived(split, 20.0)
    assert ledger.backlog(20.0) == 0  # its prompt is computed on the prefill worker


def test_a_split_request_that_falls_back_to_a_local_prefill_joins_the_backlog() -> None:
    ledger = FirstTokenLedger()
    handoff = Handoff(id="b" * 32, prefill_worker="p0", wait_s=10)
    split = make_request("sim", "req-fallback-0001").model_copy(update={"handoff": handoff})
    ledger.arrived(split, 10.0)
    assert ledger.backlog(10.0) == 0
    ledger.prefilled_here(split.request_id, 50, 12.0)  # the KV did not come in time
    assert ledger.backlog(12.0) == 50
    ledger.prefilled_here(split.request_id, 50, 12.0)  # told twice: counted once
    assert ledger.backlog(12.0) == 50
    ledger.first_token(split.request_id, 12.5)
    assert ledger.backlog(12.5) == 0
    assert ledger.rate == 0.0  # its time measures no rate
