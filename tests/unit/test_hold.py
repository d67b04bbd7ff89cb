from dispatcher.hold import FairQueue, Held, Hold, team_weights
from plumbing.protocol.request import served_already
from queue_schemas.messages import InferenceRequest, Priority, SamplingParams, Tier
from queue_schemas.teams import TeamRecord


def held(
    rid: str,
    team: str,
    priority: Priority = Priority.INTERACTIVE,
    start_by: float = 1e12,
    tier: Tier = Tier.DEFAULT,
) -> Held:
    request = InferenceRequest(
        request_id=f"req-{rid:0>8}", pool="sim", model="m", team=team, prompt_token_ids=(1,) * 10,
        sampling=SamplingParams(max_tokens=10), priority=priority, created_at=0, start_by=start_by,
        deadline=1e12, tier=tier,
    )  # fmt: skip
    return Held(request, partition=("t", 0), offset=int(rid), arrived=0.0)


def order(hold: Hold) -> list[str]:
    return [h.request.request_id.removeprefix("req-").lstrip("0") for h in hold.ordered()]


def test_interactive_before_batch() -> None:
    hold = Hold(10)
    hold.add(held("1", "a", Priority.BATCH))
    hold.add(held("2", "a"))
    assert order(hold) == ["2", "1"]


def test_teams_take_turns_so_a_flood_cannot_starve_others() -> None:
    hold = Hold(100)
    for i in range(1, 6):
        hold.add(held(str(i), "flood"))
    hold.add(held("9", "quiet"))
    assert order(hold)[:2] == ["9", "1"]  # level at zero: the team with less waiting first


def test_least_served_team_goes_first() -> None:
    hold = Hold(10)
    hold.add(held("1", "heavy"))
    hold.add(held("2", "light"))
    hold.charge("heavy", 1000)
    assert order(hold) == ["2", "1"]


def test_a_team_back_from_idle_starts_level_with_the_least_served() -> None:
    hold = Hold(10)
    hold.add(held("1", "busy"))
    hold.charge("busy", 500)
    hold.add(held("2", "newcomer"))
    # Floored at the least-served active team (500), not at 0: the tie goes to the earlier arrival.
    assert order(hold) == ["1", "2"]
    hold.charge("busy", 1)
    assert order(hold) == ["2", "1"]


def test_duplicates_capacity_removal_and_expiry() -> None:
    hold = Hold(2)
    assert hold.add(held("1", "a"))
    assert not hold.add(held("1", "a"))
    assert hold.add(held("2", "b", start_by=5.0))
    assert hold.full
    assert [h.request.request_id for h in hold.expired(now=6.0)] == ["req-00000002"]
    assert hold.remove("req-00000001") is not None
    assert hold.remove("req-00000001") is None
    assert len(hold) == 1
    assert hold.size(Priority.INTERACTIVE) == 1
    assert hold.held_by_team() == {"b": 1}
    assert [h.offset for h in hold.from_partitions({("t", 0)})] == [2]
    assert hold.from_partitions({("u", 0)}) == []


def test_bands_follow_the_engine_priority_tiers_then_batch() -> None:
    hold = Hold(10)
    hold.add(held("1", "a", Priority.BATCH))
    hold.add(held("2", "a", tier=Tier.FLEX))
    hold.add(held("3", "a"))
    hold.add(held("4", "b", tier=Tier.PRIORITY))
    hold.add(held("5", "a", Priority.BATCH, tier=Tier.PRIORITY))  # batch is batch, whatever its tier
    assert order(hold) == ["4", "3", "2", "1", "5"]
    assert hold.size(Priority.BATCH) == 2


def test_weight_scales_the_share_of_tokens_while_both_teams_wait() -> None:
    """Placing one request at a time, always the head of the order: a team of weight 3 gets three
    placements for every one of a team of weight 1."""
    hold = Hold(1000)
    hold.set_weights({"gold": 3.0})
    for i in range(1, 201):
        hold.add(held(str(i), "gold" if i % 2 else "plain"))
    placed = []
    for _ in range(80):
        first = next(hold.ordered())
        hold.remove(first.request.request_id)
        hold.charge(first.request.team, first.cost)
        placed.append(first.request.team)
    assert placed.count("gold") == 60
    assert placed.count("plain") == 20


def test_fair_queue_is_the_same_order_over_any_item() -> None:
    queue: FairQueue[str] = FairQueue()
    for item, band, team in [("b1", 3, "x"), ("x1", 1, "x"), ("x2", 1, "x"), ("y1", 1, "y"), ("p1", 0, "z")]:
        queue.add(item, band, team)
    assert list(queue.ordered()) == ["p1", "y1", "x1", "x2", "b1"]  # y has less waiting
    queue.charge("y", 50)
    assert list(queue.ordered()) == ["p1", "x1", "y1", "x2", "b1"]  # x has been served less
    queue.remove("x1", 1, "x")
    assert list(queue.ordered()) == ["p1", "x2", "y1", "b1"]


def test_team_weights_read_from_team_records() -> None:
    heavy = TeamRecord(team="heavy", weight=4).model_dump_json().encode()
    assert team_weights(["heavy", "none", "broken"], [heavy, None, b"{not json"]) == {"heavy": 4.0}


def test_fair_tags_order_the_engine_as_the_hold_orders_teams() -> None:
    hold = Hold(100)
    hold.add(held("1", "flood"))
    hold.charge("flood", 500)
    hold.add(held("2", "quiet"))  # level with the least-served active team: 500
    hold.charge("quiet", 62)
    assert (hold.tag("flood"), hold.tag("quiet"), hold.tag("new")) == (500, 562, 0)
    tagged = held("3", "flood").request.model_copy(update={"fair_tag": hold.tag("flood")})
    later = held("4", "quiet").request.model_copy(update={"fair_tag": hold.tag("quiet")})
    assert tagged.engine_priority < later.engine_priority
    # A band's largest tag still comes before the next band's smallest.
    worst = held("5", "x").request.model_copy(update={"fair_tag": 10**15})
    assert worst.engine_priority < held("6", "y", tier=Tier.FLEX).request.engine_priority


def test_on_a_tie_the_team_with_less_waiting_goes_first() -> None:
    hold = Hold(100)
    for i in range(1, 5):
        hold.add(held(str(i), "flood"))
    hold.charge("flood", 500)
    hold.add(held("9", "quiet"))  # back from idle: level with flood at 500, one request waiting
    assert order(hold)[:2] == ["9", "1"]


def test_a_record_read_again_is_recognised_as_the_one_held() -> None:
    """A reassignment resets the consumer's position, so a record whose request is still held is
    delivered again. Only a different record of the same request is a duplicate to be done with; the
    same record's offset must stay open, or it is committed before its request is placed and lost if the
    partition then moves."""
    hold = Hold(10)
    first = held("7", "a")
    assert hold.add(first)
    again = held("7", "a")
    assert not hold.add(again)
    assert hold.holds_record(first.request.request_id, ("t", 0), 7)
    assert not hold.holds_record(first.request.request_id, ("t", 0), 8)  # a resubmission, later
    assert not hold.holds_record(first.request.request_id, ("t", 1), 7)
    assert not hold.holds_record("req-00000099", ("t", 0), 7)


def test_a_batch_record_read_again_is_served_already_only_once_started_where_claimed() -> None:
    assert not served_already(None, None, None)  # never placed
    assert not served_already(b"w1", None, None)  # claimed by a dispatcher that died before appending
    assert not served_already(b"w3", b"w9", None)  # moved to w3 off a lost w9, not started by w3 yet
    assert served_already(b"w1", b"w1", None)
    assert served_already(None, None, b"1")  # answered: a resubmission
