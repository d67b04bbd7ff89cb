"""Capacity arithmetic for a pool: from model shape and GPU to replicas, GPUs and cost. Pure.

Every input has a preset and can be overridden; `sluice plan` prints each step with its formula, and the
scaler can take its per-replica capacity default from the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plumbing.window import (
    FLUSH_BASE_MS,
    FLUSH_KNEE_STREAMS,
    FLUSH_MAX_MS,
    chunks_per_stream_s,
    flush_window_s,
)

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_billion: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int = 0
    intermediate: int = 0
    dtype_bytes: int = 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, for every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params_billion * 1e9 * self.dtype_bytes

    def module_shape(self, module: str) -> tuple[int, int]:
        """(inputs, outputs) of a projection a LoRA adapter can target."""
        kv = self.kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden, self.hidden), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
            "o_proj": (self.hidden, self.hidden), "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden),
        }  # fmt: skip
        if module not in shapes:
            raise ValueError(f"unknown LoRA target module {module!r}; known: {', '.join(shapes)}")
        return shapes[module]

    def adapter_bytes(self, rank: int, modules: tuple[str, ...]) -> int:
        """One adapter slot: A (rank x inputs) and B (outputs x rank) per module and layer."""
        per_layer = sum(rank * sum(self.module_shape(m)) for m in modules)
        return self.layers * per_layer * self.dtype_bytes


# What vLLM allocates a LoRA slot for: every projection of a Llama-style layer, at max_lora_rank.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    price_per_hour: float  # an assumption to override with your own contract price


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 2000
    output_tokens: int = 300
    peak_requests_per_s: float = 20.0
    headroom: float = 1.3  # provision this much above the peak
    decode_tokens_per_s_per_seq: float = 25.0  # per sequence at full batch
    time_to_first_token_s: float = 0.8


@dataclass(frozen=True)
class Deployment:
    tensor_parallel: int = 4
    gpu_memory_utilization: float = 0.90
    overhead_gib_per_gpu: float = 3.0  # activations, CUDA graphs, runtime
    max_num_seqs: int = 256
    max_loras: int = 0  # LoRA adapter slots (vLLM preallocates them)
    lora_rank: int = 16
    lora_modules: tuple[str, ...] = LORA_MODULES


MODELS = {
    "llama-70b": ModelShape("llama-70b", 70.6, 80, 8, 128, hidden=8192, intermediate=28672),
    "llama-8b": ModelShape("llama-8b", 8.0, 32, 8, 128, hidden=4096, intermediate=14336),
    "qwen-32b": ModelShape("qwen-32b", 32.8, 64, 8, 128, hidden=5120, intermediate=27648),
}
GPUS = {
    "h100": Gpu("H100 80GB", 80.0, 2.50),
    "h200": Gpu("H200 141GB", 141.0, 3.50),
}


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    gpu: Gpu
    workload: Workload
    deployment: Deployment
    kv_bytes_per_token: int
    adapter_bytes: int
    replica_memory_bytes: float
    kv_budget_bytes: float
    kv_token_capacity: int
    tokens_per_request: int
    concurrent_per_replica: int
    request_seconds: float
    requests_per_s_per_replica: float
    replicas: int
    gpus: int
    cost_per_million_output_tokens: float

    def steps(self) -> list[tuple[str, str, str]]:
        """(quantity, value, how) for each step, in order."""
        m, g, w, d = self.model, self.gpu, self.workload, self.deployment
        rows = [
            ("KV bytes per token", f"{self.kv_bytes_per_token / 1024:.0f} KiB",
             f"2 x {m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} x {m.dtype_bytes} B"),
            ("weights", f"{m.weight_bytes / GIB:.1f} GiB", f"{m.params_billion}B params x {m.dtype_bytes} B"),
            ("replica memory", f"{self.replica_memory_bytes / GIB:.1f} GiB",
             f"{d.tensor_parallel} x {g.memory_gib} GiB x {d.gpu_memory_utilization}"),
            ("LoRA adapter slots", f"{d.max_loras * self.adapter_bytes / GIB:.2f} GiB",
             f"{d.max_loras} x {self.adapter_bytes / 2**20:.0f} MiB (rank {d.lora_rank} x (in + out) of "
             f"{', '.join(d.lora_modules)} x {m.layers} layers x {m.dtype_bytes} B)"),
            ("KV budget", f"{self.kv_budget_bytes / GIB:.1f} GiB",
             f"replica memory - weights - {d.tensor_parallel} x {d.overhead_gib_per_gpu} GiB overhead "
             "- LoRA slots"),
            ("KV token capacity", f"{self.kv_token_capacity:,}", "KV budget / KV bytes per token"),
            ("tokens per request", f"{self.tokens_per_request:,}",
             f"{w.prompt_tokens} prompt + {w.output_tokens} output"),
            ("concurrent requests per replica", f"{self.concurrent_per_replica}",
             f"min(KV capacity / tokens per request, max_num_seqs {d.max_num_seqs})"),
            ("seconds per request", f"{self.request_seconds:.1f}",
             f"TTFT {w.time_to_first_token_s} s + {w.output_tokens} / {w.decode_tokens_per_s_per_seq} tok/s"),
            ("requests/s per replica", f"{self.requests_per_s_per_replica:.2f}",
             "concurrent / seconds per request"),
            ("replicas at peak", f"{self.replicas}",
             f"ceil({w.peak_requests_per_s} req/s x {w.headroom} headroom / per-replica rate)"),
            ("GPUs at peak", f"{self.gpus}", f"replicas x {d.tensor_parallel}"),
            ("cost per million output tokens", f"${self.cost_per_million_output_tokens:.2f}",
             f"{d.tensor_parallel} GPUs x ${g.price_per_hour}/h / output tokens per replica-hour"),
        ]  # fmt: skip
        return [row for row in rows if d.max_loras or not row[0].startswith("LoRA")]


def plan(model: ModelShape, gpu: Gpu, workload: Workload, deployment: Deployment) -> Plan:
    kv_per_token = model.kv_bytes_per_token
    replica_memory = deployment.tensor_parallel * gpu.memory_gib * GIB * deployment.gpu_memory_utilization
    overhead = deployment.tensor_parallel * deployment.overhead_gib_per_gpu * GIB
    adapter = (
        model.adapter_bytes(deployment.lora_rank, deployment.lora_modules) if deployment.max_loras else 0
    )
    kv_budget = replica_memory - model.weight_bytes - overhead - deployment.max_loras * adapter
    if kv_budget <= 0:
        raise ValueError(
            f"{model.name} does not fit on {deployment.tensor_parallel} x {gpu.name}: "
            f"weights {model.weight_bytes / GIB:.0f} GiB, usable {replica_memory / GIB:.0f} GiB"
        )
    kv_tokens = int(kv_budget // kv_per_token)
    per_request = workload.prompt_tokens + workload.output_tokens
    concurrent = min(kv_tokens // per_request, deployment.max_num_seqs)
    if concurrent < 1:
        raise ValueError(f"one request of {per_request} tokens does not fit in {kv_tokens} KV tokens")
    seconds = workload.time_to_first_token_s + workload.output_tokens / workload.decode_tokens_per_s_per_seq
    rate = concurrent / seconds
    replicas = math.ceil(workload.peak_requests_per_s * workload.headroom / rate)
    output_per_replica_hour = rate * workload.output_tokens * 3600
    cost = deployment.tensor_parallel * gpu.price_per_hour / output_per_replica_hour * 1e6
    return Plan(
        model, gpu, workload, deployment, kv_per_token, adapter, replica_memory, kv_budget, kv_tokens,
        per_request, concurrent, seconds, rate, replicas, replicas * deployment.tensor_parallel, cost,
    )  # fmt: skip


# The control plane: Redis shards, Kafka partitions, ingress and dispatcher replicas.


@dataclass(frozen=True)
class ControlFigures:
    """What one unit of the control plane carries, as measured by `python -m bench.control_plane`
    (docs/scale.md has the runs); override with figures from your own hardware."""

    chunks_per_shard_s: float = 85_000  # one Valkey primary (one thread), logged and sharded-published
    replay_bytes_per_token: float = 90  # Redis memory per token held in a replay log
    chunks_per_ingress_core_s: float = 13_100  # relayed as SSE by one ingress process
    requests_per_ingress_core_s: float = 410  # admitted: auth, tokenization, quota, produce, subscribe
    ingress_kib_per_stream: float = 76  # resident memory of an ingress per open stream
    placements_per_dispatcher_core_s: float = 970  # consumed, decided, claimed and appended
    requests_per_partition_s: float = 1_000  # an assumption for a production Kafka, not measured here
    utilization: float = 0.6  # run every unit at most this busy, for bursts and failover


@dataclass(frozen=True)
class ControlTraffic:
    open_streams: int
    requests_per_s: float
    tokens_per_stream_s: float = 20.0
    requests_per_worker: int = 128  # running at each worker: sets its coalescing window
    log_after_end_s: float = 120.0  # a replay log is kept this long after its stream ends
    pools: int = 1
    ingress_cores: int = 4  # one ingress process per core
    ingress_memory_gib: float = 8.0
    shard_memory_gib: float = 24.0  # usable memory of one Redis primary


@dataclass(frozen=True)
class ControlPlan:
    traffic: ControlTraffic
    figures: ControlFigures
    window_s: float
    chunks_per_stream_s: float
    chunks_per_s: float
    shards_for_throughput: int
    seconds_per_stream: float
    logged_tokens: float
    replay_memory_gib: float
    shards_for_memory: int
    shards: int
    partitions_per_pool: int
    ingress_cores_needed: float
    ingress_for_cpu: int
    ingress_for_memory: int
    ingress_replicas: int
    dispatchers_per_pool: int

    def steps(self) -> list[tuple[str, str, str]]:
        t, f = self.traffic, self.figures
        u = f.utilization
        per_pool = t.requests_per_s / t.pools
        return [
            ("coalescing window", f"{self.window_s * 1000:.0f} ms",
             f"{FLUSH_BASE_MS:g} ms x {t.requests_per_worker} requests per worker / {FLUSH_KNEE_STREAMS}, "
             f"{FLUSH_BASE_MS:g} to {FLUSH_MAX_MS:g} ms (plumbing.window)"),
            ("chunks per stream-second", f"{self.chunks_per_stream_s:g}",
             f"min({t.tokens_per_stream_s:g} tokens/s, 1 / window)"),
            ("chunks per second", f"{self.chunks_per_s:,.0f}",
             f"{t.open_streams:,} open streams x {self.chunks_per_stream_s:g} chunks/s"),
            ("Redis shards for throughput", f"{self.shards_for_throughput}",
             f"ceil(chunks/s / ({f.chunks_per_shard_s:,.0f} per shard x {u} utilization))"),
            ("seconds per stream", f"{self.seconds_per_stream:.1f}",
             f"{t.open_streams:,} open / {t.requests_per_s:,.0f} req/s (Little's law)"),
            ("tokens held in replay logs", f"{self.logged_tokens:,.0f}",
             f"open streams x half their tokens + {t.requests_per_s:,.0f} req/s x {t.log_after_end_s:.0f} s "
             "after the end x all their tokens"),
            ("replay log memory", f"{self.replay_memory_gib:,.0f} GiB",
             f"tokens held x {f.replay_bytes_per_token:.0f} B"),
            ("Redis shards for memory", f"{self.shards_for_memory}",
             f"ceil(replay memory / ({t.shard_memory_gib} GiB x {u}))"),
            ("Redis shards (primaries)", f"{self.shards}", "the larger; add a replica to each for failover"),
            ("Kafka partitions per pool", f"{self.partitions_per_pool}",
             f"max(ceil({per_pool:,.0f} req/s / {f.requests_per_partition_s:,.0f} per partition), "
             "2 x dispatchers)"),
            ("ingress cores", f"{self.ingress_cores_needed:,.0f}",
             f"(chunks/s / {f.chunks_per_ingress_core_s:,.0f} + req/s / {f.requests_per_ingress_core_s:,.0f})"
             f" / {u}"),
            ("ingress replicas", f"{self.ingress_replicas}",
             f"max(cores / {t.ingress_cores} per replica = {self.ingress_for_cpu}, open streams x "
             f"{f.ingress_kib_per_stream:.0f} KiB / ({t.ingress_memory_gib} GiB x {u}) = "
             f"{self.ingress_for_memory})"),
            ("dispatchers per pool", f"{self.dispatchers_per_pool}",
             f"max(2, ceil({per_pool:,.0f} req/s / "
             f"({f.placements_per_dispatcher_core_s:,.0f} per core x {u})))"),
        ]  # fmt: skip


def control_plan(traffic: ControlTraffic, figures: ControlFigures = ControlFigures()) -> ControlPlan:
    """Size the control plane for `traffic` from per-unit `figures`."""
    if traffic.open_streams < 0 or traffic.requests_per_s <= 0:
        raise ValueError("open streams must be >= 0 and requests per second > 0")
    u = figures.utilization
    window = flush_window_s(
        FLUSH_BASE_MS / 1000, FLUSH_MAX_MS / 1000, traffic.requests_per_worker, FLUSH_KNEE_STREAMS
    )
    per_stream = chunks_per_stream_s(traffic.tokens_per_stream_s, window)
    chunks = traffic.open_streams * per_stream
    for_throughput = math.ceil(chunks / (figures.chunks_per_shard_s * u))
    seconds = traffic.open_streams / traffic.requests_per_s
    tokens_per_answer = seconds * traffic.tokens_per_stream_s
    logged = traffic.open_streams * tokens_per_answer / 2
    logged += traffic.requests_per_s * traffic.log_after_end_s * tokens_per_answer
    memory_gib = logged * figures.replay_bytes_per_token / GIB
    for_memory = math.ceil(memory_gib / (traffic.shard_memory_gib * u))
    per_pool = traffic.requests_per_s / traffic.pools
    dispatchers = max(2, math.ceil(per_pool / (figures.placements_per_dispatcher_core_s * u)))
    partitions = max(math.ceil(per_pool / figures.requests_per_partition_s), 2 * dispatchers)
    cores = (
        chunks / figures.chunks_per_ingress_core_s
        + traffic.requests_per_s / figures.requests_per_ingress_core_s
    ) / u
    for_cpu = math.ceil(cores / traffic.ingress_cores)
    for_streams = math.ceil(
        traffic.open_streams * figures.ingress_kib_per_stream * 1024 / (traffic.ingress_memory_gib * GIB * u)
    )
    return ControlPlan(
        traffic, figures, window, per_stream, chunks, for_throughput, seconds, logged, memory_gib, for_memory,
        max(1, for_throughput, for_memory), partitions, cores, for_cpu, for_streams,
        max(2, for_cpu, for_streams), dispatchers,
    )  # fmt: skip
