from __future__ import annotations

from pydantic import Field

from queue_schemas.settings import BusSettings


class DispatcherSettings(BusSettings):
    pool: str = Field(default="sim", description="the pool whose requests topic this dispatcher consumes")
    view_refresh_s: float = Field(default=0.25, gt=0, description="how often worker heartbeats are re-read")
    hold_poll_s: float = Field(
        default=0.05, gt=0, description="retry interval while no worker can take a request"
    )
    placement_ttl_s: int = Field(default=24 * 3600, gt=0, description="how long a placement record is kept")
    inbox_max_len: int = Field(default=100_000, gt=0)
    metrics_port: int = Field(default=0, ge=0, le=65535, description="0 disables the /metrics listener")
