"""The prefix chain hash of token ids, shared by ingress (at admission) and workers (for the KV index).

Block i's hash covers block i's token ids and block i-1's hash, so equal hashes at position i mean the
whole prefix up to and including block i is equal. Only full blocks are hashed, as engines cache only
full blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = b"sluice-prefix-v1"


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: str | None = None) -> list[str]:
    """Hex hashes (16 bytes each) of every full block of `token_ids`, chained from the first.

    `parent_hash` continues a chain: the hash of the block that precedes `token_ids[0]`.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[str] = []
    parent = _ROOT if parent_hash is None else bytes.fromhex(parent_hash)
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent + struct.pack(f"<{len(block)}I", *block), digest_size=16).digest()
        hashes.append(digest.hex())
        parent = digest
    return hashes
