"""Translating an engine's own KV block events into the project's chain hashes of token ids.

vLLM names blocks by its own hashes; the dispatcher's prefix index and the ingress speak the chain hash
of `queue_schemas.prefix`. A stored event carries the blocks' token ids and the parent block, so the
translation is exact as long as the parent was seen; a block whose parent is unknown (events missed)
cannot be named and is skipped, and so are its descendants. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from gpu_workers.engine import KvChange
from queue_schemas.messages import KvEventKind
from queue_schemas.prefix import SALT_TAG, block_hashes


class KvTranslator:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._names: dict[Hashable, str] = {}
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._names)

    def stored(
        self,
        engine_hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        salt: str | None = None,
    ) -> KvChange | None:
        """`salt` is the cache salt of a chain's first block (None: unsalted); later blocks follow their
        parent."""
        if parent is None:
            parent_name = None
        elif parent in self._names:
            parent_name = self._names[parent]
        else:
            self.skipped += len(engine_hashes)
            return None
        ours = block_hashes(token_ids, self.block_size, parent_name, salt if parent is None else None)
        if len(ours) != len(engine_hashes):
            self.skipped += len(engine_hashes)
            return None
        fresh: list[str] = []
        for engine_hash, name in zip(engine_hashes, ours, strict=True):
            if engine_hash not in self._names:
                fresh.append(name)
            self._names[engine_hash] = name
        return (KvEventKind.STORED, tuple(fresh)) if fresh else None

    def removed(self, engine_hashes: Sequence[Hashable]) -> KvChange | None:
        gone = [name for h in engine_hashes if (name := self._names.pop(h, None)) is not None]
        return (KvEventKind.REMOVED, tuple(gone)) if gone else None

    def cleared(self) -> KvChange:
        self._names.clear()
        return (KvEventKind.CLEARED, ())


def salt_of(extra_keys: Sequence[Sequence[object] | None] | None) -> str | None:
    """The cache salt among a stored event's extra keys for its first block (vLLM puts the salt there,
    beside LoRA names and multimodal keys), or None."""
    first = extra_keys[0] if extra_keys else None
    return next((k for k in first or () if isinstance(k, str) and k.startswith(SALT_TAG)), None)
