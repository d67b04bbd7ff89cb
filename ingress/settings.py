from __future__ import annotations

from pydantic import Field

from queue_schemas.settings import BusSettings


class IngressSettings(BusSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    request_timeout_s: float = Field(default=600.0, gt=0, description="deadline given to each request")
    keepalive_s: float = Field(default=10.0, gt=0, description="SSE comment interval while waiting")
    stream_outage_s: float = Field(
        default=30.0,
        gt=0,
        description="how long open streams wait for a lost Redis connection to come back before they end",
    )
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
