from prometheus_client import Counter

TEAM_TOKENS = Counter(
    "sluice_worker_team_tokens",
    "Tokens served (prompt and completion, as charged) per team, counted when a request ends",
    ["pool", "team"],
)
