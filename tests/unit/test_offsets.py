from dispatcher.offsets import OffsetTracker


def test_commit_stops_at_the_oldest_open_record() -> None:
    t: OffsetTracker[int] = OffsetTracker()
    for off in (10, 11, 12):
        t.opened(0, off)
    t.closed(0, 11)
    t.closed(0, 12)
    assert t.to_commit() == {0: 10}
    t.committed({0: 10})
    assert t.to_commit() == {}
    t.closed(0, 10)
    assert t.to_commit() == {0: 13}


def test_partitions_are_independent_and_can_be_forgotten() -> None:
    t: OffsetTracker[int] = OffsetTracker()
    t.opened(0, 5)
    t.opened(1, 7)
    t.closed(1, 7)
    assert t.to_commit() == {0: 5, 1: 8}
    t.forget({0})
    assert t.to_commit() == {1: 8}
    assert t.safe(0) is None
