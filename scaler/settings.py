from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from queue_schemas.settings import BusSettings


class ScalerSettings(BusSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8010, ge=0, le=65535)
    tick_s: float = Field(default=2.0, gt=0, description="how often each pool is measured and decided")
    health_stale_s: float = Field(
        default=60.0, gt=0, description="/healthz answers 503 when no scaling round succeeded for this long"
    )
    backend: Literal["dry-run", "local", "kubernetes"] = Field(
        default="dry-run", description="`local` starts and drains worker processes on this machine"
    )
    kubernetes_namespace: str = "sluice"
    kubernetes_workload: str = Field(default="sluice-worker-{pool}", description="Deployment name per pool")
    worker_log_dir: Path = Field(
        default=Path(".sluice/logs"), description="where local workers write their logs"
    )
    shutdown_drain_s: float = Field(
        default=20.0, ge=0, description="how long local workers get to drain at exit"
    )
