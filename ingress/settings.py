from __future__ import annotations

from pydantic import Field

from queue_schemas.batch_api import MAX_FILE_BYTES
from queue_schemas.messages import MAX_KEEP_LOG_S
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
    responses_retain_s: int = Field(
        default=3600,
        ge=60,
        le=MAX_KEEP_LOG_S,
        description="how long past its deadline a stored /v1/responses response, and the events a "
        "stream is resumed from, are kept",
    )
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    files_store: str = Field(
        default=".sluice/files",
        description="where /v1/files keeps file contents: a local folder or s3://bucket/prefix",
    )
    files_max_bytes: int = Field(default=MAX_FILE_BYTES, gt=0, le=MAX_FILE_BYTES)
    batch_keeper_interval_s: float = Field(
        default=0.5, gt=0, description="how often the batch keeper and the usage relay look for work"
    )
    usage_claim_idle_s: float = Field(
        default=30.0,
        gt=0,
        description="how long a usage entry taken by a relay may stay unsent before another relay takes it",
    )
