"""What a worker reports for the dispatcher's latency model (plumbing.latency). Pure: the worker feeds it
as requests arrive, start producing and end; the heartbeat reads it.

- the prefill rate: prompt tokens per second, measured on requests that found no prefill queued ahead
  of them and a running slot free (their uncached tokens over their time to first token less the
  decode steps the latency model adds: one and a half, and one per chunk), smoothed;
- the prefill backlog: uncached prompt tokens of the requests it holds that have no first token yet (as
  the placing dispatcher counted them, else the whole prompt; none for a request whose prompt a prefill
  worker computes), less what it has computed of them since
  they arrived at the measured rate (the engine prefills without pause, in arrival order), and never more
  than what those requests hold;
- the decode step: the mean gap between two tokens of a stream while no prompt waits for its first
  token (so no prefill chunk lengthens the steps), smoothed;
- the correction: observed over predicted first-token times (from the placement time the dispatcher
  wrote on the request), and the mean relative error of the corrected prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plumbing.latency import Correction, LatencyDefaults
from queue_schemas.messages import InferenceRequest, PlacementNote

STEP_WEIGHT = 0.05  # per token gap: about the last few hundred tokens
RATE_WEIGHT = 0.2  # per measured request
RATE_MIN_TOKENS = 1024  # shorter prompts' first tokens are mostly step time, not prefill
CHUNK_TOKENS = LatencyDefaults().chunk_tokens
SLOT_WAIT_S = 0.05  # a request that took longer than this to get a running slot waited for one


@dataclass(slots=True)
class Waiting:
    tokens: int
    note: PlacementNote | None
    arrived_at: float
    ahead: float  # prefill tokens queued ahead of it when it arrived


class FirstTokenLedger:
    def __init__(self) -> None:
        self._waiting: dict[str, Waiting] = {}
        self._held = 0  # uncached tokens of the requests without a first token
        self._work = 0.0  # prefill work left at `_since`
        self._since = 0.0
        self.rate = 0.0  # measured prefill tokens per second (0: none measured yet)
        self.correction = Correction()
        self.step_s = 0.0

    def backlog(self, now: float) -> int:
        """Prefill tokens left to compute at `now`."""
        return round(min(self._held, self._left(now)))

    def _left(self, now: float) -> float:
        if self.rate <= 0:
            return self._work
        return max(0.0, self._work - max(0.0, now - self._since) * self.rate)

    def arrived(self, request: InferenceRequest, now: float) -> None:
        """A request taken from the inbox (waiting for a slot, or started)."""
        if request.request_id in self._waiting:
            return
        note = request.placement
        tokens = note.uncached_tokens if note is not None else len(request.prompt_token_ids)
        if request.handoff is not None:
            tokens = 0
        ahead = min(float(self._held), self._left(now))
        self._waiting[request.request_id] = Waiting(tokens, note, now, ahead)
        self._held += tokens
        self._work, self._since = ahead + tokens, now

    def prefilled_here(self, request_id: str, tokens: int, now: float) -> None:
        """A split request whose KV did not come: the worker computes its prompt itself after all."""
        entry = self._waiting.get(request_id)
        if entry is None or entry.tokens:
            return
        entry.tokens, entry.ahead = tokens, math.inf  # (its time measures no rate)
        self._held += tokens
        self._work, self._since = min(float(self._held), self._left(now) + tokens), now

    def started(self, request_id: str, now: float) -> None:
        """It took a running slot. One that waited for it does not measure the prefill rate."""
        entry = self._waiting.get(request_id)
        if entry is not None and now - entry.arrived_at > SLOT_WAIT_S:
            entry.ahead = math.inf

    def first_token(self, request_id: str, now: float) -> None:
        """Its first output: it leaves the backlog, its time may measure the rate, and counts toward the
        correction."""
        entry = self._leave(request_id, now)
        if entry is None:
            return
        elapsed = now - entry.arrived_at
        if entry.ahead == 0 and entry.tokens >= RATE_MIN_TOKENS and elapsed > 0:
            steps = 1.5 + math.ceil(entry.tokens / CHUNK_TOKENS)
            sample = entry.tokens / max(elapsed / 4, elapsed - steps * self.step_s)
            self.rate = sample if self.rate == 0 else self.rate + RATE_WEIGHT * (sample - self.rate)
        if entry.note is not None:
            self.correction.observe(entry.note.predicted_ttft_s, now - entry.note.placed_at)

    def ended(self, request_id: str, now: float) -> None:
        """It ended without a first token (refused, cancelled, failed, moved)."""
        self._leave(request_id, now)

    def _leave(self, request_id: str, now: float) -> Waiting | None:
        entry = self._waiting.pop(request_id, None)
        if entry is not None:
            self._held -= entry.tokens
            self._work, self._since = min(float(self._held), self._left(now)), now
        return entry

    def tokens_after(self, gap_s: float, tokens: int) -> None:
        """`tokens` more of a stream came `gap_s` after its previous output (a decode step's sample only
        while no prompt is waiting for its first token)."""
        if tokens <= 0 or gap_s < 0 or self._held > 0:
            return
        per_token = gap_s / tokens
        self.step_s = per_token if self.step_s == 0 else self.step_s + STEP_WEIGHT * (per_token - self.step_s)
