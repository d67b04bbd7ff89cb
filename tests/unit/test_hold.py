from dispatcher.hold import Held, Hold
from queue_schemas.messages import InferenceRequest, Priority, SamplingParams


def held(rid: str, team: str, priority: Priority = Priority.INTERACTIVE, start_by: float = 1e12) -> Held:
    request = InferenceRequest(
        request_id=f"req-{rid:0>8}", pool="sim", model="m", team=team, prompt_token_ids=(1,) * 10,
        sampling=SamplingParams(max_tokens=10), priority=priority, created_at=0, start_by=start_by,
        deadline=1e12,
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
    assert order(hold)[:2] == ["1", "9"]


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
    assert [h.offset for h in hold.from_partitions({("t", 0)})] == [2]
    assert hold.from_partitions({("u", 0)}) == []
