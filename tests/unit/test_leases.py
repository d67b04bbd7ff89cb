"""How dispatchers split a pool's partitions by lease: the pure decision."""

from __future__ import annotations

from dispatcher.leases import fair_share, plan

REQ = [("req", p) for p in range(4)]
BATCH = [("batch", p) for p in range(4)]


def test_shares_add_up_to_the_partitions_and_differ_by_at_most_one() -> None:
    for members in (["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d", "e"]):
        shares = [fair_share(m, members, 4) for m in members]
        assert sum(shares) == 4, members
        assert max(shares) - min(shares) <= 1, members


def test_a_lone_dispatcher_claims_everything_free() -> None:
    decided = plan(REQ + BATCH, {}, "a", ["a"])
    assert sorted(decided.claim) == sorted(REQ + BATCH)
    assert decided.over_share == ()


def test_a_second_dispatcher_takes_half_once_the_first_hands_it_back() -> None:
    owners: dict[tuple[str, int], str | None] = {p: "a" for p in REQ + BATCH}
    first = plan(REQ + BATCH, owners, "a", ["a", "b"])
    assert len(first.over_share) == 4, "two of each topic go back"
    assert first.claim == ()
    assert plan(REQ + BATCH, owners, "b", ["a", "b"]).claim == (), "nothing is taken from a live holder"
    for p in first.over_share:
        owners[p] = None  # handed back
    second = plan(REQ + BATCH, owners, "b", ["a", "b"])
    assert sorted(second.claim) == sorted(first.over_share)


def test_a_dead_holders_partitions_are_free_to_the_living() -> None:
    owners: dict[tuple[str, int], str | None] = {p: ("a" if p[1] < 2 else "b") for p in REQ}
    assert plan(REQ, owners, "b", ["a", "b"]).claim == ()
    taken = plan(REQ, owners, "b", ["b"])  # a's registration lapsed
    assert sorted(taken.claim) == [("req", 0), ("req", 1)]
