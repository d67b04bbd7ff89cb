from scaler.lag import partition_lag, pool_lag


def test_lag_is_end_minus_committed() -> None:
    assert partition_lag(10, 4) == 6


def test_no_commit_counts_everything_from_log_start() -> None:
    assert partition_lag(10, None) == 10
    assert partition_lag(10, -1, log_start=3) == 7


def test_lag_never_goes_negative() -> None:
    # The dev broker can report an end offset below the committed one.
    assert partition_lag(5, 9) == 0


def test_pool_lag_sums_partitions() -> None:
    lag = pool_lag("sim", "t", "g", {0: 10, 1: 5, 2: 0}, {0: 7, 1: None}, {}, read_at=1.0)
    assert dict(lag.partitions) == {0: 3, 1: 5, 2: 0}
    assert lag.total == 8


def test_pool_lag_keeps_commits_and_arrivals_and_prefers_a_higher_reported_mark() -> None:
    lag = pool_lag("sim", "t", "g", {0: 10, 1: 5}, {0: 7, 1: None}, {}, read_at=1.0, highwater={0: 12})
    assert dict(lag.partitions) == {0: 5, 1: 5}  # 12 - 7: the consumer saw more than ListOffsets said
    assert dict(lag.committed) == {0: 7}
    assert lag.end_total == 17
    lower = pool_lag("sim", "t", "g", {0: 10}, {0: 7}, {}, read_at=1.0, highwater={0: 9})
    assert dict(lower.partitions) == {0: 3}
