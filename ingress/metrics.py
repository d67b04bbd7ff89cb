from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "sluice_ingress_requests_total", "Completion requests by pool and outcome", ["pool", "outcome"]
)
TTFT = Histogram(
    "sluice_ingress_ttft_seconds",
    "Time from admission to the first token chunk",
    ["pool"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
INTER_TOKEN = Histogram(
    "sluice_ingress_inter_token_seconds",
    "Time between streamed chunks at ingress, per token they carry",
    ["pool"],
    buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5),
)
ACTIVE_STREAMS = Gauge("sluice_ingress_active_requests", "Requests waiting for or receiving tokens", ["pool"])
REJECTIONS = Counter(
    "sluice_ingress_rejections_total", "Requests refused at admission, by reason", ["pool", "reason"]
)
