"""The coalescing window of a worker's chunks, and the chunk rate it gives a stream. Pure.

A worker gathers a request's tokens for up to a window before it writes them as one chunk (the first
token goes out at once). The window widens with the requests the worker is running, so the bus's and the
ingress's work per token falls as load rises (gpu_workers.coalesce); the capacity plan (scaler.plan)
takes a stream's chunk rate from the same rule.
"""

from __future__ import annotations

FLUSH_BASE_MS = 15.0  # the window of a lightly loaded worker
FLUSH_KNEE_STREAMS = 16  # requests running past which it widens
FLUSH_MAX_MS = 100.0  # the widest it gets: a reader sees text at least this often


def flush_window_s(base_s: float, max_s: float, streams: int, knee: int) -> float:
    """The coalescing window with `streams` requests running at the worker: `base_s` up to `knee`, then
    in proportion to them, so the worker's chunks per second level off, up to `max_s`."""
    if streams <= knee or knee <= 0:
        return base_s
    return max(base_s, min(max_s, base_s * streams / knee))


def chunks_per_stream_s(tokens_per_s: float, window_s: float) -> float:
    """Chunks a second of a stream decoding `tokens_per_s` through a window of `window_s`: a token per
    chunk while tokens come slower than the window, else about one chunk a window."""
    if window_s <= 0:
        return tokens_per_s
    return min(tokens_per_s, 1 / window_s)
