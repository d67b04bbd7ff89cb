"""Predicted latency of a request on a worker, in seconds. Pure: the dispatcher's placement and split
decision, the worker's report of its own error, the dashboard and the fleet simulator use the same
functions, on scalars or on numpy columns.

An engine runs steps. Each decodes one token for every running request and computes up to
`chunk_tokens` of the prompts waiting to be prefilled, in arrival order (vLLM's chunked prefill). A
worker reports in its heartbeat:

- `step_s`: a decode step at its running batch (token gaps measured while no prompt waits);
- `prefill_tokens_per_s`: prompt tokens it computes per second of prefill work;
- `prefill_backlog`: uncached prompt tokens of the requests it holds that have no first token yet.

The prefill work queued there now is that backlog less what the worker computed since it reported it
(`backlog_now`), plus what the dispatcher placed there since. A request with `uncached` tokens to
compute has its first token after the rest of the step in progress, the prefill of everything ahead of
it and of its own tokens (each chunk one more step), and the wait for a running slot when all are
taken:

    ttft = step_s / 2 + tokens / prefill_rate + ceil(tokens / chunk) * step_s + slot_wait,
    tokens = prefill work queued + uncached

times the worker's correction: the smoothed ratio of observed to predicted first-token times of the
requests it finished (`Correction`), which takes up what the heartbeat's figures miss (their age,
prefix hits the dispatcher did not know of, a rate measured under another load).

Its prefill also stalls the requests running there: each of their next tokens waits for it. Spread over
a request's expected output, that is the inter-token latency it adds to them:

    itl_after = step_s + (uncached / prefill_rate) / expected_output_tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from queue_schemas.messages import Heartbeat

Floats = npt.NDArray[np.float64]
Number = Floats | float  # every function takes scalars or columns, and answers an array of either shape


@dataclass(frozen=True, slots=True)
class LatencyDefaults:
    """What the model assumes of a worker that has not measured its own figures yet (a pool's settings)."""

    prefill_tokens_per_s: float = 8_000.0
    step_s: float = 0.03
    chunk_tokens: int = 2048
    adapter_load_s: float = 0.05  # loading a LoRA adapter the worker does not hold
    request_s: float = 8.0  # a request's time in a running slot, until the worker reports completions


def prefill_s(tokens: Number, rate: Number, step_s: Number, chunk: int) -> Floats:
    """Seconds to compute `tokens` prompt tokens: their compute, and a decode step per chunk."""
    n = np.asarray(tokens, dtype=float)
    return np.asarray(n / rate + np.ceil(n / chunk) * np.asarray(step_s, dtype=float))


def backlog_now(backlog: Number, age_s: Number, rate: Number, step_s: Number, chunk: int) -> Floats:
    """The reported backlog less what the worker has computed since its report, `age_s` ago (a chunk's
    worth of tokens per step)."""
    per_token = 1 / np.asarray(rate, dtype=float) + np.asarray(step_s, dtype=float) / chunk
    done = np.maximum(0.0, np.asarray(age_s, dtype=float)) / per_token
    return np.asarray(np.maximum(0.0, np.asarray(backlog, dtype=float) - done))


def slot_wait_s(load: Number, slots: Number, completed_per_s: Number, request_s: float = 8.0) -> Floats:
    """The wait for a running slot: the requests beyond the worker's slots, this one included, over the
    rate at which it finishes requests (until it reports one, its slots over `request_s`, a request's
    time in a slot). 0 where slots are free or not stated."""
    slots_ = np.asarray(slots, dtype=float)
    beyond = np.maximum(0.0, np.asarray(load, dtype=float) + 1 - slots_)
    completed = np.asarray(completed_per_s, dtype=float)
    rate = np.maximum(np.where(completed > 0, completed, slots_ / request_s), 1e-3)
    return np.asarray(np.where(slots_ > 0, beyond / rate, 0.0), dtype=float)


def predicted_ttft(
    uncached: Number,
    backlog: Number,
    rate: Number,
    step_s: Number,
    chunk: int,
    wait_s: Number = 0.0,
    correction: Number = 1.0,
) -> Floats:
    """Seconds from placement to the first token (see the module doc)."""
    ahead = np.asarray(backlog, dtype=float) + uncached
    step = np.asarray(step_s, dtype=float)
    return np.asarray((step / 2 + prefill_s(ahead, rate, step, chunk) + wait_s) * correction)


def itl_after(uncached: Number, rate: Number, step_s: Number, expected_output_tokens: int) -> Floats:
    """The mean inter-token latency of the requests running on the worker once this one's prefill is
    spread over an expected output (see the module doc)."""
    stall = np.asarray(uncached, dtype=float) / rate
    return np.asarray(step_s + stall / max(1, expected_output_tokens))


@dataclass(slots=True)
class Correction:
    """A worker's ratio of observed to predicted first-token times, smoothed in log space (so a request
    twice too slow and one twice too fast cancel), and the mean relative error of the corrected
    prediction over the same requests: the model's stated error on that worker."""

    weight: float = 0.1
    log_ratio: float = 0.0
    error: float = 0.0
    samples: int = 0

    @property
    def factor(self) -> float:
        return math.exp(self.log_ratio)

    def observe(self, predicted_s: float, observed_s: float) -> None:
        """One finished first token: what the model (uncorrected) predicted, what was observed."""
        if predicted_s <= 0 or observed_s <= 0 or not math.isfinite(predicted_s + observed_s):
            return
        corrected = predicted_s * self.factor
        miss = abs(observed_s - corrected) / observed_s
        ratio = math.log(observed_s / predicted_s)
        w = 1.0 if self.samples == 0 else self.weight
        # Bounded: one outlier (a preempted request, a paused engine) moves the factor by at most e^w.
        self.log_ratio += w * max(-1.0, min(1.0, ratio - self.log_ratio))
        self.error = miss if self.samples == 0 else (1 - self.weight) * self.error + self.weight * miss
        self.samples += 1


def heartbeat_ttft(
    hb: Heartbeat,
    uncached: int,
    now: float,
    defaults: LatencyDefaults,
    extra_tokens: int = 0,
    extra_requests: int = 0,
) -> tuple[float, float]:
    """(corrected, uncorrected) predicted TTFT on the worker of `hb` for a request with `uncached` tokens
    to compute, `extra_tokens` and `extra_requests` placed there since the heartbeat."""
    rate = hb.prefill_tokens_per_s or defaults.prefill_tokens_per_s
    step = hb.step_s or defaults.step_s
    queued = hb.prefill_backlog + extra_tokens
    backlog = float(backlog_now(queued, now - hb.sent_at, rate, step, defaults.chunk_tokens))
    load = hb.running + hb.waiting + hb.inbox_pending + extra_requests
    wait = float(slot_wait_s(float(load), float(hb.max_running), hb.completed_per_s, defaults.request_s))
    raw = float(predicted_ttft(float(uncached), backlog, rate, step, defaults.chunk_tokens, wait))
    return raw * hb.ttft_correction, raw
