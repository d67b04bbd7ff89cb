from prometheus_client import Counter, Gauge

PARTITION_LAG = Gauge("sluice_consumer_lag", "Dispatcher-group lag per partition", ["pool", "partition"])
POOL_LAG = Gauge("sluice_pool_lag", "Dispatcher-group lag summed over a pool's partitions", ["pool"])
BATCH_LAG = Gauge(
    "sluice_pool_batch_lag", "Batch submissions not yet committed by the pool's dispatchers", ["pool"]
)
LAG_READ_AT = Gauge("sluice_lag_read_timestamp_seconds", "When the pool's lag was last read", ["pool"])
LAG_STATUS = Gauge(
    "sluice_lag_status", "1 for the pool's current lag status (Burrow's terms)", ["pool", "status"]
)
HELD = Gauge("sluice_pool_held", "Requests held by the pool's dispatchers", ["pool"])
BACKLOG = Gauge("sluice_pool_backlog", "Lag (held requests included) + undelivered inbox entries", ["pool"])
ARRIVAL = Gauge("sluice_pool_arrival_rate", "Requests per second arriving, smoothed", ["pool"])
FORECAST = Gauge("sluice_pool_forecast_rate", "Arrival rate forecast one replica start-up ahead", ["pool"])
CAPACITY = Gauge(
    "sluice_pool_replica_capacity", "Requests per second one replica serves (measured)", ["pool"]
)
STARTUP = Gauge("sluice_pool_replica_startup_seconds", "Replica start-up time (measured)", ["pool"])
REPLICAS = Gauge("sluice_pool_replicas", "Replicas by state, and the desired count", ["pool", "state"])
DECISIONS = Counter("sluice_scaler_decisions_total", "Scaling verdicts by action", ["pool", "action"])
SPEC_DECODING = Gauge(
    "sluice_pool_spec_decoding", "1 if new replicas start with speculative decoding", ["pool"]
)
WORKER_KV_USED = Gauge(
    "sluice_worker_kv_used_ratio", "Share of a worker's KV blocks in use", ["pool", "worker"]
)
WORKER_RUNNING = Gauge("sluice_worker_running", "Requests a worker is running", ["pool", "worker"])
WORKER_WAITING = Gauge(
    "sluice_worker_waiting", "Requests queued at a worker (engine queue and inbox)", ["pool", "worker"]
)
WORKER_PREFIX_HIT = Gauge(
    "sluice_worker_prefix_hit_ratio",
    "Prompt tokens found in the prefix cache, of those looked up",
    ["pool", "worker"],
)
WORKER_PREEMPTIONS = Gauge(
    "sluice_worker_preemptions",
    "Running requests the worker's engine preempted (sent back to wait, KV freed), in total since it started",
    ["pool", "worker"],
)
WORKER_GAUGES = (WORKER_KV_USED, WORKER_RUNNING, WORKER_WAITING, WORKER_PREFIX_HIT, WORKER_PREEMPTIONS)
