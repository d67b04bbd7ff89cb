"""When a worker's write sets the replay log's expiry (plumbing.replay.expiry_to_set)."""

from plumbing.replay import LOG_AFTER_END_MS, MIN_LOG_TTL_MS, expiry_to_set, log_ttl_ms

DEADLINE = 10_000.0


def test_a_running_log_is_given_its_expiry_once() -> None:
    now = DEADLINE - 600
    first = expiry_to_set(log_ttl_ms(DEADLINE, now, False), now, None)
    assert first == (DEADLINE - now) * 1000 + LOG_AFTER_END_MS, "the first write sets it"
    until = now + first / 1000
    for later in (now + 1, now + 100, DEADLINE - 70):
        assert expiry_to_set(log_ttl_ms(DEADLINE, later, False), later, until) is None, later


def test_the_end_and_the_floor_near_the_deadline_set_it_again() -> None:
    now = DEADLINE - 600
    until = now + log_ttl_ms(DEADLINE, now, False) / 1000
    end = DEADLINE - 300
    assert expiry_to_set(log_ttl_ms(DEADLINE, end, True), end, until) == LOG_AFTER_END_MS
    late = DEADLINE + 90  # well past the deadline the floor keeps the log a minute from now
    assert expiry_to_set(log_ttl_ms(DEADLINE, late, False), late, until) == MIN_LOG_TTL_MS
