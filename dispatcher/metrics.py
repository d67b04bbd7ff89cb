from prometheus_client import Counter, Gauge, Histogram

PLACEMENTS = Counter("sluice_dispatcher_placements_total", "Requests placed on workers", ["pool"])
RECEIVED = Counter(
    "sluice_dispatcher_received_total", "Records read from the pool's topics", ["pool", "topic_kind"]
)
OUTCOMES = Counter(
    "sluice_dispatcher_outcomes_total",
    "Requests leaving the dispatcher other than by placement",
    # duplicate, redelivered, cancelled, timeout, dead_letter, dead_letter_refused, worker_lost
    ["pool", "outcome"],
)
DECISION_SECONDS = Histogram(
    "sluice_dispatcher_decision_seconds",
    "Time to choose a worker for one request",
    ["pool"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
)
QUEUED_SECONDS = Histogram(
    "sluice_dispatcher_hold_seconds",
    "Time a request spent in the hold before placement",
    ["pool"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
)
HOLD_SIZE = Gauge(
    "sluice_dispatcher_held_requests", "Requests held for lack of a worker", ["pool", "priority"]
)
TEAM_HELD = Gauge(
    "sluice_dispatcher_team_held_requests", "Requests held for lack of a worker, per team", ["pool", "team"]
)
TEAM_PLACED_TOKENS = Counter(
    "sluice_dispatcher_team_placed_tokens",
    "Tokens placed on workers per team (prompt plus max_tokens, what the fair order counts)",
    ["pool", "team"],
)
PREFIX_BLOCKS = Counter(
    "sluice_dispatcher_prefix_blocks_total",
    "Prompt blocks of placed requests, and how many were already cached on the chosen worker",
    ["pool", "kind"],  # prompt, matched
)
COMMIT_ROUNDS = Counter(
    "sluice_dispatcher_commit_rounds_total",
    "Rounds that committed the offsets the dispatcher is done with (nothing, while it holds them all)",
    ["pool"],
)
RECOVERED = Counter("sluice_dispatcher_recovered_total", "Requests moved off a lost worker", ["pool"])
CONSUMING = Gauge(
    "sluice_dispatcher_partitions", "Partitions this dispatcher consumes (leased to it)", ["pool"]
)
PAUSED = Gauge("sluice_dispatcher_paused", "1 while the hold is full and partitions are paused", ["pool"])
MIGRATIONS = Counter(
    "sluice_dispatcher_migrations_total",
    "Requests of lost workers, by what became of them: moved (to go on from their delivered tokens), "
    "restarted (nothing was delivered), ended (their last chunk was out) or refused (they end with "
    "worker_lost)",
    ["pool", "outcome"],
)
SPLITS = Counter(
    "sluice_dispatcher_split_decisions_total",
    "Placements of a pool with prefill workers: prefill on a prefill worker (split) or where it decodes",
    ["pool", "decision", "reason"],
)
