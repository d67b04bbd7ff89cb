"""vLLM's own per-step figures, gathered by a stat logger it calls: running and waiting requests, KV use,
preemptions, decode rate."""

from __future__ import annotations

import time
from collections import deque
from typing import Any


class EngineFigures:
    """The latest scheduler figures and running totals, as the stat logger hands them over. Pure."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.preemptions = 0
        self._generated: deque[tuple[float, int]] = deque()

    def record(self, scheduler: Any, iteration: Any, now: float) -> None:
        if scheduler is not None:
            self.running = int(scheduler.num_running_reqs)
            self.waiting = int(scheduler.num_waiting_reqs)
            self.kv_usage = float(scheduler.kv_cache_usage)
            prefix = scheduler.prefix_cache_stats
            if prefix is not None and not prefix.reset:
                self.prefix_queries += int(prefix.queries)
                self.prefix_hits += int(prefix.hits)
            spec = scheduler.spec_decoding_stats
            if spec is not None:
                self.spec_drafted += int(spec.num_draft_tokens)
                self.spec_accepted += int(spec.num_accepted_tokens)
        if iteration is not None:
            self.preemptions += int(iteration.num_preempted_reqs)
            if iteration.num_generation_tokens:
                self._generated.append((now, int(iteration.num_generation_tokens)))

    def tokens_per_s(self, now: float, window_s: float = 5.0) -> float:
        while self._generated and now - self._generated[0][0] > window_s:
            self._generated.popleft()
        return sum(n for _, n in self._generated) / window_s


def stat_logger_class(base: type[Any], figures: EngineFigures) -> type[Any]:
    """A vLLM stat logger class that hands each step's figures to `figures`."""

    class SluiceStatLogger(base):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            figures.record(scheduler_stats, iteration_stats, time.monotonic())

        def log_engine_initialized(self) -> None:
            return None

    return SluiceStatLogger
