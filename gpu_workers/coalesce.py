"""Coalescing engine outputs into sequence-numbered chunks. Pure bookkeeping, no I/O.

The first token goes out at once (time to first token matters most); later tokens are gathered for up
to `flush_after_s` so a fast decoder does not cost one publish per token.
"""

from __future__ import annotations

from gpu_workers.engine import EngineOutput
from queue_schemas.messages import FinalChunk, TokenChunk, Usage


class ChunkCoalescer:
    def __init__(self, request_id: str, worker_id: str, flush_after_s: float) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self.flush_after_s = flush_after_s
        self.seq = 0
        self.completion_tokens = 0
        self._parts: list[str] = []
        self._pending_tokens = 0
        self._last_flush: float | None = None

    def add(self, out: EngineOutput, now: float) -> TokenChunk | FinalChunk | None:
        """Take one engine output; return the chunk to publish now, if any."""
        self._parts.append(out.text)
        self._pending_tokens += out.num_tokens
        self.completion_tokens += out.num_tokens
        if out.finish_reason is not None:
            usage = Usage(
                prompt_tokens=out.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=out.cached_tokens,
            )
            final = FinalChunk(
                request_id=self.request_id,
                seq=self.seq,
                text=self._take_text(),
                num_tokens=self._take_tokens(),
                finish_reason=out.finish_reason,
                usage=usage,
                worker_id=self.worker_id,
            )
            self.seq += 1
            return final
        if self._last_flush is not None and now - self._last_flush < self.flush_after_s:
            return None
        self._last_flush = now
        chunk = TokenChunk(
            request_id=self.request_id, seq=self.seq, text=self._take_text(), num_tokens=self._take_tokens()
        )
        self.seq += 1
        return chunk

    def flush(self) -> TokenChunk | None:
        """The tokens still gathered, as a chunk; used before an error so nothing generated is withheld."""
        if not self._pending_tokens and not any(self._parts):
            return None
        chunk = TokenChunk(
            request_id=self.request_id, seq=self.seq, text=self._take_text(), num_tokens=self._take_tokens()
        )
        self.seq += 1
        return chunk

    def _take_text(self) -> str:
        text = "".join(self._parts)
        self._parts.clear()
        return text

    def _take_tokens(self) -> int:
        n, self._pending_tokens = self._pending_tokens, 0
        return n
