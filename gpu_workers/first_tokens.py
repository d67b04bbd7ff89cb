"""What a worker reports for the dispatcher's latency model (plumbing.latency). Pure: the worker feeds it
as requests arrive, start producing and end; the heartbeat reads it.

- the prefill backlog: uncached prompt tokens of the requests it holds that have no first token yet
  (as the placing dispatcher counted them, else the whole prompt);
- the decode step: the mean gap between two tokens of a stream, smoothed;
- the correction: observed over predicted first-token times (from the placement time the dispatcher
  wrote on the request), and the mean relative error of the corrected prediction.
"""

from __future__ import annotations

from plumbing.latency import Correction
from queue_schemas.messages import InferenceRequest, PlacementNote

STEP_WEIGHT = 0.05  # per token gap: about the last few hundred tokens


class FirstTokenLedger:
    def __init__(self) -> None:
        self._waiting: dict[str, tuple[int, PlacementNote | None]] = {}
        self.backlog = 0
        self.correction = Correction()
        self.step_s = 0.0

    def arrived(self, request: InferenceRequest) -> None:
        """A request taken from the inbox (waiting for a slot, or started)."""
        if request.request_id in self._waiting:
            return
        note = request.placement
        tokens = note.uncached_tokens if note is not None else len(request.prompt_token_ids)
        self._waiting[request.request_id] = (tokens, note)
        self.backlog += tokens

    def first_token(self, request_id: str, now: float) -> None:
        """Its first output: it leaves the backlog, and its time counts toward the correction."""
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return
        tokens, note = entry
        self.backlog -= tokens
        if note is not None:
            self.correction.observe(note.predicted_ttft_s, now - note.placed_at)

    def ended(self, request_id: str) -> None:
        """It ended without a first token (refused, cancelled, failed, moved)."""
        entry = self._waiting.pop(request_id, None)
        if entry is not None:
            self.backlog -= entry[0]

    def tokens_after(self, gap_s: float, tokens: int) -> None:
        """`tokens` more of a stream came `gap_s` after its previous output."""
        if tokens <= 0 or gap_s < 0:
            return
        per_token = gap_s / tokens
        self.step_s = per_token if self.step_s == 0 else self.step_s + STEP_WEIGHT * (per_token - self.step_s)
