"""API keys and the team record they map to. Keys are stored only as SHA-256 hex digests."""

from __future__ import annotations

import hashlib
import secrets

from pydantic import BaseModel, ConfigDict, Field

from queue_schemas.messages import Name

KEY_PREFIX = "sk-sluice-"


class TeamKey(BaseModel):
    """What `apikey:<sha256>` holds: whose key it is and what it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    team: Name
    key_id: str = Field(description="first characters of the key, safe to show in listings and logs")
    pools: tuple[str, ...] = Field(default=(), description="pools this key may use; empty means all")
    created_at: float
    allow_priority: bool = Field(
        default=False, description="requests may ask for service_tier priority (ahead of default traffic)"
    )

    adapters: tuple[str, ...] = Field(
        default=(), description="LoRA adapters this key may use; empty means every adapter of its pools"
    )

    def allows_pool(self, pool: str) -> bool:
        return not self.pools or pool in self.pools

    def allows_model(self, pool: str, adapter: str | None) -> bool:
        """Whether the key may use the pool, and the adapter if the request names one."""
        return self.allows_pool(pool) and (adapter is None or not self.adapters or adapter in self.adapters)


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(key: str) -> str:
    return key[: len(KEY_PREFIX) + 6]
