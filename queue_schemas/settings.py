"""Settings every service shares: where the bus is and how to talk to it (`SLUICE_*` environment)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from queue_schemas.config import SluiceConfig, load_config
from queue_schemas.names import Names


class BusSettings(BaseSettings):
    """Built once in each entry point and passed down; never at import time."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore", frozen=True)

    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = Field(default="sluice", pattern=r"^[a-z0-9][a-z0-9_\-]*$")
    config: Path | None = Field(default=None, description="pool file; the packaged default when unset")
    # Tansu answers a waiting fetch only when the wait expires, so the dev stack keeps this small.
    kafka_fetch_wait_ms: int = Field(default=100, ge=0)
    kafka_session_timeout_ms: int = Field(default=10_000, gt=0)
    kafka_heartbeat_interval_ms: int = Field(default=3_000, gt=0)
    kafka_request_timeout_ms: int = Field(default=10_000, gt=0)
    redis_max_connections: int = Field(default=64, gt=0)
    connect_attempts: int = Field(
        default=30, gt=0, description="start-up retries before giving up on the bus"
    )
    model_cache_dir: Path = Field(
        default=Path.home() / ".cache" / "sluice" / "models",
        description="where `s3://` model sources (weights, tokenizers) are downloaded and re-used",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = False

    @property
    def names(self) -> Names:
        return Names(self.prefix)

    def load_pools(self) -> SluiceConfig:
        return load_config(self.config)
