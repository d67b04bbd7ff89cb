from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field

from plumbing.window import FLUSH_BASE_MS, FLUSH_KNEE_STREAMS, FLUSH_MAX_MS
from queue_schemas.messages import KvRole
from queue_schemas.settings import BusSettings


def default_worker_id() -> str:
    host = socket.gethostname().split(".")[0].lower()
    cleaned = "".join(c if c.isalnum() or c in "-_" else "-" for c in host) or "worker"
    return f"{cleaned}-{os.getpid()}"


class WorkerSettings(BusSettings):
    pool: str = "sim"
    worker_id: str = Field(default_factory=default_worker_id, pattern=r"^[a-z0-9][a-z0-9_\-]*$")
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    inbox_lookahead: int = Field(
        default=64,
        ge=0,
        description="inbox entries read beyond the free slots, so a freed slot takes the highest-priority "
        "(then oldest) of them",
    )
    heartbeat_ttl_ms: int = Field(default=3_000, gt=0)
    flush_interval_ms: float = Field(
        default=FLUSH_BASE_MS, ge=0, description="how long token deltas are coalesced"
    )
    flush_knee_streams: int = Field(
        default=FLUSH_KNEE_STREAMS,
        ge=0,
        description="requests running at the worker past which the window widens (0: never)",
    )
    flush_max_ms: float = Field(
        default=FLUSH_MAX_MS, ge=0, description="the widest the coalescing window gets under load"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, description="how long a draining worker finishes work")
    drain_grace_s: float = Field(
        default=1.0, ge=0, description="placements made before dispatchers saw `draining` arrive within this"
    )
    bus_outage_s: float = Field(
        default=30.0, gt=0, description="how long a stream waits for Redis to come back before it ends"
    )
    spec_decoding: bool = Field(default=False, description="start the engine with speculative decoding")
    role: KvRole = Field(
        default="both",
        description="with the pool's KV connector: prefill (saves KV), decode (loads it) or both",
    )
    metrics_port: int = Field(default=0, ge=0, le=65535, description="0 disables the /metrics listener")
    state_file: Path | None = Field(
        default=None, description="file the worker keeps its state in (ready, draining...) for probes"
    )
    metrics_host: str = Field(default="127.0.0.1", description="0.0.0.0 where Prometheus scrapes pods")
