"""Settings every service shares: where the bus is and how to talk to it (`SLUICE_*` environment)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, model_validator
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
    redis_cluster: bool = Field(
        default=False,
        description="redis_url names a node of a Redis Cluster: keys are routed by slot and streams "
        "use sharded pub/sub (SPUBLISH, SSUBSCRIBE)",
    )
    batch_headroom_fraction: float = Field(
        default=0.25,
        ge=0,
        lt=1,
        description="share of each worker's running slots (and KV blocks) batch requests leave to "
        "interactive ones: dispatchers place batch only into the rest, and workers start batch only there",
    )
    connect_attempts: int = Field(
        default=30, gt=0, description="start-up retries before giving up on the bus"
    )
    model_cache_dir: Path = Field(
        default=Path.home() / ".cache" / "sluice" / "models",
        description="where `s3://` model sources (weights, tokenizers) are downloaded and re-used",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = False
    # Tracing: spans go to an OTLP endpoint set by the standard OTEL_* variables, and, with
    # trace_timeline, to Redis for the dashboard's request timeline (plumbing.tracing). Off when neither.
    trace_timeline: bool = Field(
        default=False, description="record each request's spans in Redis for the dashboard's timeline"
    )
    trace_timeline_ttl_s: int = Field(
        default=900, gt=0, le=86_400, description="how long a request's recorded spans are kept"
    )
    # Transport security; docs/operations.md shows each setting against a production cluster.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_ssl_cafile: Path | None = Field(default=None, description="CA bundle for the brokers' certificates")
    kafka_ssl_certfile: Path | None = Field(default=None, description="client certificate (mutual TLS)")
    kafka_ssl_keyfile: Path | None = Field(default=None, description="client key (mutual TLS)")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    redis_password: SecretStr | None = Field(default=None, description="AUTH password; overrides the URL's")
    redis_username: str | None = Field(default=None, description="ACL user; overrides the URL's")
    redis_ssl_ca_certs: Path | None = Field(default=None, description="CA bundle; needs a rediss:// URL")
    redis_ssl_certfile: Path | None = Field(default=None, description="client certificate (mutual TLS)")
    redis_ssl_keyfile: Path | None = Field(default=None, description="client key (mutual TLS)")

    @model_validator(mode="after")
    def _security(self) -> Self:
        protocol = self.kafka_security_protocol
        if protocol.startswith("SASL") and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(f"SLUICE_KAFKA_SECURITY_PROTOCOL={protocol} needs a SASL username and password")
        uses_tls = protocol in ("SSL", "SASL_SSL")
        kafka_tls = (self.kafka_ssl_cafile, self.kafka_ssl_certfile, self.kafka_ssl_keyfile)
        if not uses_tls and any(kafka_tls):
            raise ValueError(f"Kafka TLS files are set but SLUICE_KAFKA_SECURITY_PROTOCOL is {protocol}")
        redis_tls = (self.redis_ssl_ca_certs, self.redis_ssl_certfile, self.redis_ssl_keyfile)
        if any(redis_tls) and not self.redis_url.startswith("rediss://"):
            raise ValueError("Redis TLS files are set but SLUICE_REDIS_URL is not a rediss:// URL")
        for what, cert, key in (
            ("Kafka", self.kafka_ssl_certfile, self.kafka_ssl_keyfile),
            ("Redis", self.redis_ssl_certfile, self.redis_ssl_keyfile),
        ):
            if (cert is None) != (key is None):
                raise ValueError(f"{what} client TLS needs both a certificate and a key file")
        return self

    @property
    def names(self) -> Names:
        return Names(self.prefix)

    @property
    def stream_publish(self) -> str:
        """The command that publishes a stream chunk: sharded on a Redis Cluster, so a chunk goes only to
        the shard of its channel's slot instead of to every node."""
        return "SPUBLISH" if self.redis_cluster else "PUBLISH"

    def load_pools(self) -> SluiceConfig:
        return load_config(self.config)
