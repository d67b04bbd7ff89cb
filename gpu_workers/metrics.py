from prometheus_client import Counter, Histogram

TEAM_TOKENS = Counter(
    "sluice_worker_team_tokens",
    "Tokens served (prompt and completion, as charged) per team, counted when a request ends",
    ["pool", "team"],
)
HANDOFFS = Counter(
    "sluice_worker_handoffs_total",
    "Disaggregated requests at their decode worker: KV loaded from the prefill worker, or a local prefill",
    ["pool", "outcome"],  # loaded, fallback
)
HANDOFF_SECONDS = Histogram(
    "sluice_worker_handoff_seconds",
    "From a decode worker asking for a request's prefill to its KV ready (or the fallback)",
    ["pool"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PREFILL_JOBS = Counter(
    "sluice_worker_prefill_jobs_total", "Prefill jobs a prefill worker ran", ["pool", "outcome"]
)
