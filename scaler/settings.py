from __future__ import annotations

from pydantic import Field

from queue_schemas.settings import BusSettings


class ScalerSettings(BusSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8010, ge=0, le=65535)
    tick_s: float = Field(default=2.0, gt=0, description="how often lag is read")
