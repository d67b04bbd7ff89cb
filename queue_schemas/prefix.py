"""The prefix chain hash of token ids, shared by ingress (at admission) and workers (for the KV index).

Block i's hash covers block i's token ids and block i-1's hash, so equal hashes at position i mean the
whole prefix up to and including block i is equal. Only full blocks are hashed, as engines cache only
full blocks.

A chain may start from a salt (the team, by default): the same tokens under different salts give
unrelated hashes, so one team's cached prefix is never matched, placed on or reported to another. The
salt is the string vLLM receives as `cache_salt`, and comes back in its KV events, so the engine's cache
and the prefix index agree.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = b"sluice-prefix-v1"
SALT_TAG = "sluice-team:"


def cache_salt(team: str, shared: bool, adapter: str | None = None) -> str | None:
    """The salt of a team's prefixes: none where the pool shares its cache across teams. A LoRA
    adapter's name is part of it, as KV computed under one adapter is not valid under another."""
    if adapter is None:
        return None if shared else SALT_TAG + team
    return SALT_TAG + ("*" if shared else team) + "|adapter:" + adapter


def _root(salt: str | None) -> bytes:
    if salt is None:
        return _ROOT
    return hashlib.blake2b(_ROOT + b"\x00" + salt.encode(), digest_size=16).digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent_hash: str | None = None, salt: str | None = None
) -> list[str]:
    """Hex hashes (16 bytes each) of every full block of `token_ids`, chained from the first.

    `parent_hash` continues a chain: the hash of the block that precedes `token_ids[0]`. Otherwise the
    chain starts from `salt` (None: the unsalted root shared by every team).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[str] = []
    parent = _root(salt) if parent_hash is None else bytes.fromhex(parent_hash)
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent + struct.pack(f"<{len(block)}I", *block), digest_size=16).digest()
        hashes.append(digest.hex())
        parent = digest
    return hashes
