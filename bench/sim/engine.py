"""One replica as the fleet simulator models it: iteration-level timing, KV blocks and an LRU prefix cache.

Each engine step decodes one token for every running sequence and prefills up to `chunk_tokens` of the
queued prompts (chunked prefill, as vLLM schedules it). A step takes

    step_s = decode_base_s + decode_per_seq_s * running + (prefill_per_token_s * chunk if prefilling)

Between two events (an arrival, a prompt finishing its prefill, a sequence finishing) the step time is
constant, so progress is linear and the replica jumps from event to event instead of stepping. A
prompt's first token comes at the end of the step in which its prefill finishes, and no earlier than the
end of the first step that begins after its admission: as in vLLM, a prompt that arrives while a step
runs joins the next one, so even a fully cached prompt waits out the rest of the current step and one
more.

KV, as vLLM allocates it: a request is admitted when a sequence slot and the blocks of its uncached prompt
are free; otherwise it waits. A decoding sequence then takes a block for every `block_size` tokens it
generates, so what a replica reports as used never depends on how long a running request's output will
turn out to be. When the growing sequences fill the KV, the engine preempts one (vLLM's recompute
preemption: the latest admitted under `fcfs`, the lowest priority and latest arrival under `priority`):
it frees its blocks and waits again, at the front of the queue, to compute its prompt and its output so
far once more. The prefix cache (the simulated engine's `PrefixCache`) keeps prompt blocks by chain hash
in what is left, least recently used first out.

Scheduling `fcfs` (vLLM's default): waiting requests are admitted, and prefilled, in arrival order.
`priority` (vLLM's priority scheduler): interactive requests wait, and are prefilled, ahead of batch
requests that have not begun their prefill, and an interactive request that finds too few free blocks
preempts decoding batch requests, the latest arrival first: each frees its blocks and waits again, and
when re-admitted computes its prompt and its output so far again, then decodes the rest.

LoRA adapters (`max_loras` > 0), as vLLM serves them: a replica holds up to `max_loras` adapters, the
least recently used evicted; a request whose adapter is not held loads it when admitted, which takes
`adapter_load_s` of prefill time (the step that loads it is that much longer for every sequence in it);
and the sequences in one step use at most `max_loras` distinct adapters, so a waiting request for
another adapter is passed over (vLLM skips it and admits the next) until one of those finishes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from gpu_workers.prefix_cache import PrefixCache
from gpu_workers.presence import CompletionRate
from queue_schemas.messages import BATCH_ENGINE_PRIORITY, ENGINE_PRIORITY, Tier

EPS = 1e-6  # in tokens and steps; the counters grow large, so an absolute 1e-9 is below float precision


class Blocks(Protocol):
    """A set of block hashes (a prefix cache, a router's active blocks)."""

    def __contains__(self, block_hash: str, /) -> bool: ...


def leading_cached(cache: Blocks, blocks: tuple[str, ...]) -> int:
    """How many leading blocks are in `cache`, by bisection: O(log n) lookups instead of up to n.

    Exact for any set of blocks in which every chain is prefix-closed. This simulator's caches are: a
    prompt is always inserted whole from its first block, `insert` leaves a chain's blocks more recent the
    nearer they are to its start, and eviction takes the least recent, so a chain loses blocks only from
    its end. So is a router's set of active prompt blocks, which holds whole prompts.
    """
    if not blocks or blocks[0] not in cache:
        return 0  # the common case on a fleet: another tenant's replica
    lo, hi = 1, len(blocks)  # blocks[lo - 1] is cached; the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks[mid - 1] in cache:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class TimingModel:
    """Defaults: Llama-3-70B (BF16), tensor parallel over 4 H100 SXM; derived in docs/benchmarks.md."""

    decode_base_s: float = 0.0150  # weights (140 GB) read once per step at ~9.4 TB/s effective
    decode_per_seq_s: float = 0.00015  # KV reads and sampling per running sequence per step
    prefill_per_token_s: float = 0.00008  # 140 GFLOP per token at ~1.75 PFLOP/s effective
    chunk_tokens: int = 2048
    kv_blocks: int = 25_000  # 400k tokens of KV in what 4 x 80 GB leave after weights and activations
    block_size: int = 16
    max_seqs: int = 256
    scheduling: str = "fcfs"  # or "priority": see the module docstring
    max_loras: int = 0  # LoRA adapters held at once (0: no adapters modelled)
    adapter_load_s: float = 0.05  # loading one adapter not held (see docs/benchmarks.md)


@dataclass(eq=False)
class Request:
    rid: int
    arrival: float
    blocks: tuple[str, ...]  # prompt block hashes (chain: equal prefixes have equal leading hashes)
    prompt_tokens: int
    output_tokens: int
    priority: str = "interactive"
    tenant: int = 0
    max_tokens: int = 0  # what the client asked for (0: none); routers read this, never output_tokens
    placed_at: float = math.nan
    cached_tokens: int = 0
    first_token: float = math.nan
    done: float = math.nan
    replica: int = -1
    preempted: int = 0  # times the engine preempted it
    adapter: int = -1  # its LoRA adapter (-1: the base model)
    adapter_loads: int = 0  # times its admission loaded its adapter
    loaded: bool = False  # its prompt's KV was handed over by a prefill worker (bench.sim.disagg)

    @property
    def band(self) -> int:
        """Its engine priority, lower first (queue_schemas.messages.engine_priority)."""
        return BATCH_ENGINE_PRIORITY if self.priority == "batch" else ENGINE_PRIORITY[Tier.DEFAULT]


@dataclass(eq=False)
class Seq:
    request: Request
    own_blocks: int
    uncached: int = 0  # prompt tokens it prefills
    cum_end: float = 0.0  # prefill position at which its prompt is done
    finish_step: float = 0.0
    first_step: int = 0  # the earliest step whose end can bring its first token
    generated: int = 0  # output tokens it had when it was preempted (it computes them again)
    decoding: bool = False
    grow_from: float = 0.0  # the step count at which it began decoding: it has generated steps - this
    admitted: int = 0  # the replica's admission count when it was admitted (the latest is preempted first)


@dataclass(eq=False)
class Replica:
    index: int
    model: TimingModel
    ready_at: float = 0.0
    launched_at: float = 0.0  # when the scaler asked for it; ready_at - launched_at is its start-up
    draining: bool = False
    retired_at: float = math.inf
    now: float = 0.0
    steps: float = 0.0
    prefill_done: float = 0.0
    prefill_end: float = 0.0
    own_used: int = 0  # prompt blocks of the admitted sequences (what decoding adds is counted apart)
    _growing: int = 0  # decoding sequences: each takes a token's KV per step
    _grow_from_sum: float = 0.0  # the sum of their `grow_from`
    waiting: deque[Seq] = field(default_factory=deque)
    prefilling: deque[Seq] = field(default_factory=deque)
    running: list[tuple[float, int, Seq]] = field(default_factory=list)  # heap by finish step
    running_blocks: int = 0  # prompt blocks of the decoding sequences
    version: int = 0
    completed: int = 0
    completions: CompletionRate = field(default_factory=CompletionRate)  # as a worker's heartbeat counts
    waiting_tokens: int = 0  # prompt tokens of the requests in `waiting`
    preemptions: int = 0
    adapters: OrderedDict[int, None] = field(default_factory=OrderedDict)  # held, least recent first
    active: Counter[int] = field(default_factory=Counter)  # adapters of the admitted sequences
    adapter_loads: int = 0
    _unscheduled: tuple[int, int] = (-1, 0)  # (version, prompts beyond this step's prefill budget)
    cache: PrefixCache = field(init=False)
    cache_log: list[tuple[int, tuple[str, ...]]] | None = None  # inserts since the last heartbeat
    started: list[Request] = field(default_factory=list)  # first tokens since the fleet last read them
    _admissions: int = 0

    def __post_init__(self) -> None:
        self.cache = PrefixCache(self.model.kv_blocks)

    # state the routers read (the same figures vLLM reports, or a gateway tracks)
    @property
    def in_system(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def _unscheduled_prompts(self) -> int:
        """Prompts in the prefill queue that the current step's token budget does not reach: vLLM
        schedules waiting prompts while its budget lasts (a prompt it reaches is running, chunked)."""
        if self._unscheduled[0] != self.version:
            reach = self.prefill_done + self.model.chunk_tokens
            n = 0
            for seq in reversed(self.prefilling):
                if seq.cum_end - seq.uncached < reach:
                    break
                n += 1
            self._unscheduled = (self.version, n)
        return self._unscheduled[1]

    @property
    def queue(self) -> int:
        """vLLM's num_requests_waiting: requests no step has scheduled yet."""
        return len(self.waiting) + self._unscheduled_prompts()

    @property
    def scheduled(self) -> int:
        """vLLM's num_requests_running: decoding sequences plus the prompts in prefill this step."""
        return len(self.running) + len(self.prefilling) - self._unscheduled_prompts()

    def grown_tokens(self) -> float:
        """Tokens the decoding sequences have generated since they began (each adds one per step)."""
        return max(0.0, self._growing * self.steps - self._grow_from_sum)

    def used_blocks(self) -> int:
        return self.own_used + math.ceil(self.grown_tokens() / self.model.block_size - EPS)

    @property
    def free_blocks(self) -> int:
        return self.model.kv_blocks - self.used_blocks()

    @property
    def completed_per_s(self) -> float:
        """Requests finished per second recently, as a worker's heartbeat reports it."""
        return self.completions.rate(self.now)

    @property
    def cache_size(self) -> int:
        return len(self.cache)

    def prefill_tokens(self) -> int:
        """Prompt tokens routed here whose prefill has not finished (what Dynamo's router tracks)."""
        return math.ceil(self.prefill_end - self.prefill_done) + self.waiting_tokens

    def prefill_blocks(self) -> int:
        return math.ceil(self.prefill_tokens() / self.model.block_size)

    def decode_blocks(self) -> int:
        """Blocks of the decoding sequences: their prompts and what they have generated so far."""
        return self.running_blocks + math.ceil(self.grown_tokens() / self.model.block_size - EPS)

    def matched(self, blocks: tuple[str, ...]) -> int:
        return leading_cached(self.cache, blocks)

    def indexed(self, blocks: tuple[str, ...]) -> int:
        return self.matched(blocks)

    # time
    def step_s(self) -> float:
        m = self.model
        t = m.decode_base_s + m.decode_per_seq_s * len(self.running)
        if self.prefilling:
            t += m.prefill_per_token_s * m.chunk_tokens
        return t

    def advance(self, now: float) -> None:
        """Move the engine on to `now` (no event lies in between)."""
        if now <= self.now:
            return
        if self.prefilling or self.running:
            steps = (now - self.now) / self.step_s()
            self.steps += steps
            if self.prefilling:
                self.prefill_done = min(self.prefill_end, self.prefill_done + steps * self.model.chunk_tokens)
        self.now = now

    def next_event(self) -> float:
        """When the next prompt finishes prefill, the next sequence finishes or the decoding sequences
        fill the KV; inf when idle."""
        if not self.prefilling and not self.running:
            return math.inf
        steps = math.inf
        if self.prefilling:
            steps = (self.prefilling[0].cum_end - self.prefill_done) / self.model.chunk_tokens
        if self.running:
            steps = min(steps, self.running[0][0] - self.steps, self._steps_to_full())
        return self.now + max(0.0, steps) * self.step_s()

    def _steps_to_full(self) -> float:
        """Steps until a decoding sequence needs a block and none is free (never for a sequence alone
        on the replica: it was let through, see `admit`)."""
        if not self._growing or len(self.running) + len(self.prefilling) <= 1:
            return math.inf
        room = (self.model.kv_blocks - self.own_used) * self.model.block_size
        return (room + 1 + self._grow_from_sum) / self._growing - self.steps

    # work
    def place(self, request: Request, now: float) -> None:
        self.version += 1
        self.advance(now)
        if not self.prefilling and not self.running:
            self.steps = math.ceil(self.steps - EPS)  # an idle engine starts a step when work arrives
        request.placed_at = now
        request.replica = self.index
        self._wait(Seq(request, 0))
        self.admit()

    def _wait(self, seq: Seq, front: bool = False) -> None:
        """Join the waiting queue: at its end (or its head, `front`), or under `priority`, behind its own
        band and the ones before it (in arrival order within a band)."""
        self.waiting_tokens += seq.request.prompt_tokens + seq.generated
        if front:
            self.waiting.appendleft(seq)
            return
        if self.model.scheduling != "priority":
            self.waiting.append(seq)
            return
        key = (seq.request.band, seq.request.arrival)
        at = len(self.waiting)
        while at and (self.waiting[at - 1].request.band, self.waiting[at - 1].request.arrival) > key:
            at -= 1
        self.waiting.insert(at, seq)

    def admit(self) -> None:
        """Start waiting requests while a sequence slot and their KV blocks are free."""
        m = self.model
        at = 0  # the first waiting request not passed over for its adapter
        while at < len(self.waiting) and len(self.prefilling) + len(self.running) < m.max_seqs:
            seq = self.waiting[at]
            r = seq.request
            if not self._adapter_fits(r.adapter):
                at += 1
                continue
            self._fit_cache()  # what decoding took since is no longer cache
            matched = (
                len(r.blocks) if r.loaded and not seq.generated else leading_cached(self.cache, r.blocks)
            )
            uncached = max(1, r.prompt_tokens + seq.generated - matched * m.block_size)
            need = math.ceil(uncached / m.block_size)
            if need > self.free_blocks and m.scheduling == "priority":
                self._preempt_for(r.band, need)
            if need > self.free_blocks:
                if not self.running and not self.prefilling:
                    need = self.free_blocks  # alone on the replica: let it through rather than stall
                else:
                    return
            del self.waiting[at]
            self.waiting_tokens -= r.prompt_tokens + seq.generated
            uncached += self._use_adapter(r)
            if not seq.generated:
                r.cached_tokens = matched * m.block_size
            seq.own_blocks = need
            self.own_used += need
            self._admissions += 1
            seq.admitted = self._admissions
            self._fit_cache()
            self.cache.insert(r.blocks)
            if self.cache_log is not None:
                self.cache_log.append((self.cache.capacity, r.blocks))
            if not self.prefilling:
                self.prefill_done = self.prefill_end = max(self.prefill_done, self.prefill_end)
            seq.uncached = uncached
            self._queue_prefill(seq)
            seq.first_step = math.ceil(self.steps - EPS) + 1  # the step after the one in progress

    def _fit_cache(self) -> None:
        """The prefix cache keeps what the sequences leave of the KV: the least recent blocks beyond
        that are evicted (and a heartbeat's copy of the cache evicts them too)."""
        capacity = max(1, self.model.kv_blocks - self.used_blocks())
        if capacity != self.cache.capacity:
            self.cache.capacity = capacity
            if len(self.cache) > capacity:
                self.cache.insert(())
                if self.cache_log is not None:
                    self.cache_log.append((capacity, ()))

    def _blocks_of(self, seq: Seq) -> int:
        """The blocks a sequence holds: its prompt's, and if decoding, those of its output so far."""
        if not seq.decoding:
            return seq.own_blocks
        return seq.own_blocks + math.ceil(max(0.0, self.steps - seq.grow_from) / self.model.block_size - EPS)

    def _start_decoding(self, seq: Seq) -> None:
        seq.decoding, seq.grow_from = True, self.steps
        self._growing += 1
        self._grow_from_sum += seq.grow_from
        self.running_blocks += seq.own_blocks

    def _stop_decoding(self, seq: Seq) -> int:
        """It leaves the decoding sequences; returns the blocks it held, which are free again."""
        held = self._blocks_of(seq)
        seq.decoding = False
        self._growing -= 1
        self._grow_from_sum -= seq.grow_from
        if not self._growing:
            self._grow_from_sum = 0.0
        self.running_blocks -= seq.own_blocks
        self.own_used -= seq.own_blocks
        return held

    def _adapter_fits(self, adapter: int) -> bool:
        """Whether a sequence of `adapter` may join the admitted ones (at most max_loras adapters)."""
        m = self.model
        return adapter < 0 or not m.max_loras or adapter in self.active or len(self.active) < m.max_loras

    def _use_adapter(self, request: Request) -> int:
        """Admit a sequence of the request's adapter: load it if not held (evicting the least recently
        used one no admitted sequence uses); returns the load as prefill tokens."""
        adapter = request.adapter
        if adapter < 0 or not self.model.max_loras:
            return 0
        self.active[adapter] += 1
        if adapter in self.adapters:
            self.adapters.move_to_end(adapter)
            return 0
        if len(self.adapters) >= self.model.max_loras:
            idle = next((a for a in self.adapters if a not in self.active), None)
            if idle is not None:
                del self.adapters[idle]
        self.adapters[adapter] = None
        self.adapter_loads += 1
        request.adapter_loads += 1
        return math.ceil(self.model.adapter_load_s / self.model.prefill_per_token_s)

    def _release_adapter(self, adapter: int) -> None:
        if adapter >= 0 and self.model.max_loras:
            self.active[adapter] -= 1
            if not self.active[adapter]:
                del self.active[adapter]

    def held_adapters(self) -> frozenset[int]:
        """What a worker's heartbeat reports: the adapters loaded."""
        return frozenset(self.adapters)

    def active_adapters(self) -> frozenset[int]:
        """vLLM's running_lora_adapters: adapters of the admitted sequences."""
        return frozenset(self.active)

    def waiting_adapters(self) -> frozenset[int]:
        """vLLM's waiting_lora_adapters."""
        return frozenset(s.request.adapter for s in self.waiting if s.request.adapter >= 0)

    def _queue_prefill(self, seq: Seq) -> None:
        """Its prompt joins the prefill queue: at the end, or under `priority` ahead of lower bands whose
        prefill has not begun (the positions behind it move back by its length)."""
        at = len(self.prefilling)
        if self.model.scheduling == "priority":
            band = seq.request.band
            while at:
                before = self.prefilling[at - 1]
                begun = before.cum_end - before.uncached < self.prefill_done + EPS
                if before.request.band <= band or begun:
                    break
                at -= 1
        if at:
            start = self.prefilling[at - 1].cum_end
        elif self.prefilling:
            start = self.prefilling[0].cum_end - self.prefilling[0].uncached
        else:
            start = self.prefill_end
        for later in itertools.islice(self.prefilling, at, None):
            later.cum_end += seq.uncached
        seq.cum_end = start + seq.uncached
        self.prefill_end += seq.uncached
        self.prefilling.insert(at, seq)

    def _preempt_for(self, band: int, need: int) -> None:
        """Preempt decoding sequences of a lower priority (a higher band), the latest arrival first, until
        `need` blocks are free or none is left to preempt."""
        victims = sorted(
            (s for _, _, s in self.running if s.request.band > band),
            key=lambda s: (s.request.band, s.request.arrival),
        )
        chosen: list[Seq] = []
        own, grown = self.own_used, self.grown_tokens()
        while victims and need > self._free_after(own, grown):
            victim = victims.pop()
            chosen.append(victim)
            own -= victim.own_blocks
            grown -= max(0.0, self.steps - victim.grow_from)
        if need > self._free_after(own, grown):
            return  # preempting would not make room: nothing is preempted
        for victim in chosen:
            self._preempt(victim)

    def _free_after(self, own: int, grown: float) -> int:
        """Free blocks with `own` prompt blocks held and `grown` tokens generated (as `free_blocks`)."""
        return self.model.kv_blocks - own - math.ceil(max(0.0, grown) / self.model.block_size - EPS)

    def _preempt(self, seq: Seq, front: bool = False) -> None:
        """Free its blocks and send it back to wait (`front`: ahead of the others, as vLLM puts a
        sequence it preempted for lack of blocks back at the head of its waiting queue under fcfs)."""
        self.running = [entry for entry in self.running if entry[2] is not seq]
        heapq.heapify(self.running)
        self._stop_decoding(seq)
        remaining = max(1, math.ceil(seq.finish_step - self.steps - EPS))
        seq.generated = seq.request.output_tokens - remaining
        seq.own_blocks = 0
        self._fit_cache()
        self._release_adapter(seq.request.adapter)
        seq.request.preempted += 1
        self.preemptions += 1
        self._wait(seq, front=front and self.model.scheduling != "priority")

    def _relieve(self) -> None:
        """Preempt admitted sequences while the decoding ones need more blocks than there are, as vLLM
        preempts from the end of its running list: the latest admitted, decoding or still in prefill
        (fcfs), or the lowest priority and latest arrival (priority)."""
        by_priority = self.model.scheduling == "priority"
        while self.running and len(self.running) + len(self.prefilling) > 1 and self.free_blocks < 0:
            victim = max(
                itertools.chain((entry[2] for entry in self.running), self.prefilling),
                key=lambda s: (s.request.band, s.request.arrival) if by_priority else (0, s.admitted),
            )
            if victim.decoding:
                self._preempt(victim, front=True)
            else:
                self._preempt_prefill(victim)

    def _preempt_prefill(self, seq: Seq) -> None:
        """Take a sequence out of the prefill queue (what it computed is lost) and send it back to wait
        at the head of the queue."""
        at = self.prefilling.index(seq)
        start = seq.cum_end - seq.uncached
        del self.prefilling[at]
        for later in itertools.islice(self.prefilling, at, None):
            later.cum_end -= seq.uncached
        self.prefill_end -= seq.uncached
        self.prefill_done = min(self.prefill_done, start)  # the head's progress is lost; others had none
        self.version += 1
        self.own_used -= seq.own_blocks
        seq.own_blocks = 0
        self._fit_cache()
        self._release_adapter(seq.request.adapter)
        seq.request.preempted += 1
        self.preemptions += 1
        self._wait(seq, front=self.model.scheduling != "priority")

    def process(self, now: float) -> list[Request]:
        """Finish what is due at `now`; returns requests that completed."""
        self.version += 1
        self.advance(now)
        finished: list[Request] = []
        while self.prefilling and self.prefilling[0].cum_end <= self.prefill_done + EPS:
            seq = self.prefilling.popleft()
            # The step that finishes a prompt samples its first token (or a resumed sequence its next
            # one) when that step ends.
            first = max(math.ceil(self.steps - EPS), seq.first_step)
            at = now + (first - self.steps) * self.step_s()
            if math.isnan(seq.request.first_token):
                seq.request.first_token = at
                self.started.append(seq.request)
            left = seq.request.output_tokens - seq.generated
            if left <= 1:
                finished.append(self._finish(seq, now))
                seq.request.done = at
                continue
            seq.finish_step = first + left - 1
            heapq.heappush(self.running, (seq.finish_step, seq.request.rid, seq))
            self._start_decoding(seq)
        while self.running and self.running[0][0] <= self.steps + EPS:
            _, _, seq = heapq.heappop(self.running)
            self._stop_decoding(seq)
            seq.own_blocks = 0
            finished.append(self._finish(seq, now))
        self._relieve()
        self._fit_cache()
        if finished:
            self.admit()
        return finished

    def _finish(self, seq: Seq, now: float) -> Request:
        seq.request.done = now
        self._release_adapter(seq.request.adapter)
        self.own_used -= seq.own_blocks  # a prompt finished without decoding; a decoding one has none
        seq.own_blocks = 0
        self._fit_cache()
        self.completed += 1
        self.completions.record(now)
        return seq.request
