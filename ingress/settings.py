from __future__ import annotations

from pydantic import Field

from ingress.batches.api import MAX_FILE_BYTES
from ingress.team_caps import TeamCaps
from queue_schemas.messages import MAX_KEEP_LOG_S
from queue_schemas.settings import BusSettings


class IngressSettings(BusSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    request_timeout_s: float = Field(default=600.0, gt=0, description="deadline given to each request")
    keepalive_s: float = Field(default=10.0, gt=0, description="SSE comment interval while waiting")
    cors_origins: list[str] = Field(
        default=[],
        description="web origins allowed to call the API from a browser (`*`: any); none by default",
    )
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
    responses_cancel_wait_s: float = Field(
        default=2.0,
        ge=0,
        le=30,
        description="how long cancelling a response waits for the worker's report of what it used",
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
    files_per_team: int = Field(default=500, gt=0, description="files (uploaded and results) a team may keep")
    file_bytes_per_team: int = Field(
        default=2 * 1024**3, gt=0, description="bytes of files (uploaded and results) a team may keep"
    )
    file_expiry_s: int = Field(
        default=30 * 24 * 3600,
        ge=3600,
        le=30 * 24 * 3600,
        description="how long a file is kept when its upload names no expires_after (batch results too)",
    )
    batches_per_team: int = Field(default=20, gt=0, description="batches a team may have in progress")
    batch_lines_per_team: int = Field(
        default=100_000, gt=0, description="requests a team's batches in progress may hold together"
    )
    batch_retain_s: int = Field(
        default=30 * 24 * 3600, ge=3600, description="how long a finished batch's record is kept"
    )
    responses_per_team: int = Field(
        default=256, gt=0, description="stored /v1/responses responses a team may hold at once"
    )

    def team_caps(self) -> TeamCaps:
        return TeamCaps(
            files=self.files_per_team,
            file_bytes=self.file_bytes_per_team,
            active_batches=self.batches_per_team,
            batch_lines=self.batch_lines_per_team,
            stored_responses=self.responses_per_team,
        )
