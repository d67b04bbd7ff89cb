"""Coalescing engine outputs into sequence-numbered chunks. Pure bookkeeping, no I/O.

The first token goes out at once (time to first token matters most); later tokens are gathered for up
to a window so a fast decoder does not cost one publish per token. The window widens with the requests
the worker is running (plumbing.window.flush_window_s): a worker decoding for many requests at once
publishes fewer, larger chunks, so the bus's and the ingress's work per token falls as load rises,
while a lightly loaded worker streams as smoothly as before.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_workers.engine import EngineOutput
from queue_schemas.messages import FinalChunk, Resume, TokenChunk, Usage


class ChunkCoalescer:
    """Chunks of one request. A request that moved off a lost worker goes on from its `resume`: the
    sequence numbers continue, and usage counts the client's prompt once and every output token."""

    def __init__(
        self,
        request_id: str,
        worker_id: str,
        flush_after_s: float | Callable[[], float],
        resume: Resume | None = None,
    ) -> None:
        """`flush_after_s`: the window, or a function giving it now (the worker's load changes)."""
        self.request_id = request_id
        self.worker_id = worker_id
        self._window = flush_after_s if callable(flush_after_s) else (lambda: flush_after_s)
        self.seq = 0 if resume is None else resume.next_seq
        self.completion_tokens = 0 if resume is None else resume.delivered_tokens
        self._prompt_tokens = None if resume is None else resume.prompt_tokens
        self._parts: list[str] = []
        self._tokens: list[int] = []
        self._pending_tokens = 0
        self._last_flush: float | None = None
        # The worker's span of the request, carried back on its first chunk from here and its final one.
        self.traceparent: str | None = None
        self._first = True

    def add(self, out: EngineOutput, now: float) -> TokenChunk | FinalChunk | None:
        """Take one engine output; return the chunk to publish now, if any."""
        self._parts.append(out.text)
        self._tokens.extend(out.token_ids)
        self._pending_tokens += out.num_tokens
        self.completion_tokens += out.num_tokens
        if out.finish_reason is not None:
            prompt_tokens = out.prompt_tokens if self._prompt_tokens is None else self._prompt_tokens
            usage = Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=self.completion_tokens,
                # After a move the engine's prompt holds earlier output: only the client's part counts.
                cached_tokens=min(out.cached_tokens, prompt_tokens),
            )
            final = FinalChunk(
                request_id=self.request_id,
                seq=self.seq,
                text=self._take_text(),
                num_tokens=self._take_tokens(),
                token_ids=self._take_ids(),
                finish_reason=out.finish_reason,
                usage=usage,
                worker_id=self.worker_id,
                traceparent=self.traceparent,
            )
            self.seq += 1
            return final
        if self._last_flush is not None and now - self._last_flush < self._window():
            return None
        self._last_flush = now
        chunk = TokenChunk(
            request_id=self.request_id, seq=self.seq, text=self._take_text(),
            num_tokens=self._take_tokens(), token_ids=self._take_ids(),
            traceparent=self.traceparent if self._first else None,
        )  # fmt: skip
        self._first = False
        self.seq += 1
        return chunk

    def flush(self) -> TokenChunk | None:
        """The tokens still gathered, as a chunk; used before an error so nothing generated is withheld."""
        if not self._pending_tokens and not any(self._parts):
            return None
        chunk = TokenChunk(
            request_id=self.request_id, seq=self.seq, text=self._take_text(),
            num_tokens=self._take_tokens(), token_ids=self._take_ids(),
        )  # fmt: skip
        self.seq += 1
        return chunk

    def _take_text(self) -> str:
        text = "".join(self._parts)
        self._parts.clear()
        return text

    def _take_ids(self) -> tuple[int, ...]:
        ids = tuple(self._tokens)
        self._tokens.clear()
        return ids

    def _take_tokens(self) -> int:
        n, self._pending_tokens = self._pending_tokens, 0
        return n
