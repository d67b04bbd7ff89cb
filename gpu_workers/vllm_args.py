"""The arguments sluice gives vLLM: the engine's (model, parallelism, KV cache, speculative decoding, the KV
connector, LoRA), a request's sampling parameters, and what its finish reasons mean. Pure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_workers.engine import RequestFailed, StartFailed
from queue_schemas.config import HANDOFF_CONNECTOR, KV_CONNECTOR_ROLES, PoolConfig, VllmEngineConfig
from queue_schemas.messages import FinishReason, InferenceRequest, KvRole

KV_TOPIC = b"kv"  # the topic of the engine's KV-cache events
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Where vLLM imports sluice's shared-storage handoff connector from (a path, so that vLLM, not this
# module, imports it: it imports vLLM).
HANDOFF_CONNECTOR_MODULE = "gpu_workers.kv_handoff"


def cpu_thread_binding(cores: list[int], tensor_parallel_size: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND value: the cores split into one contiguous group per rank."""
    if tensor_parallel_size > len(cores):
        raise StartFailed(
            f"tensor_parallel_size {tensor_parallel_size} needs at least as many CPU cores; {len(cores)} here"
        )
    per_rank = len(cores) // tensor_parallel_size
    groups = [cores[i * per_rank : (i + 1) * per_rank] for i in range(tensor_parallel_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def cpu_environment(config: VllmEngineConfig, cores: list[int], tensor_parallel_size: int) -> dict[str, str]:
    """The OpenMP settings of an engine on CPU, given the cores this process may use.

    - Threads per rank: the pool's `cpu_threads`, else the cores split between the ranks.
    - Binding: tensor-parallel ranks get one contiguous group of cores each. A one-rank engine of a
      pool that names `cpu_threads` shares the host with others (several workers on one machine):
      vLLM's automatic binding would put every such engine on the same first core, so the OS places
      its threads instead. Otherwise vLLM binds automatically.
    - A KV connector: vLLM reserves one more core per rank for it; on a small machine that leaves none,
      and it binds the model to every core instead. Reserve as without a connector, so a pool's prefill
      and decode engines compute as a connector-less engine does.
    - An unbound one-rank engine runs its model in the engine-core process (see `one_process_on_cpu`).
    """
    tp = tensor_parallel_size
    wanted = {"OMP_NUM_THREADS": str(config.cpu_threads or max(1, len(cores) // tp))}
    if tp > 1:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cores, tp)
    elif config.cpu_threads is not None:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if one_process_on_cpu(config, tp):
        # vLLM on CPU replaces the in-process executor with a worker process unless this is off. The
        # async engine ignores it otherwise: its engine core is a process of its own either way.
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.kv_connector is not None:
        wanted["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(tp)
    return wanted


def one_process_on_cpu(config: VllmEngineConfig, tensor_parallel_size: int) -> bool:
    """Whether a CPU engine runs its model inside vLLM's engine-core process instead of a worker process
    of its own. vLLM on CPU starts that worker process to bind its OpenMP threads to cores before they
    exist; an engine of one rank that shares its host (`cpu_threads` set, so not bound) gains nothing
    from it and pays a third interpreter importing vLLM and torch: about 9 s of start-up and its memory.
    Pure."""
    return tensor_parallel_size == 1 and config.cpu_threads is not None


def speculative_config(config: VllmEngineConfig, enabled: bool) -> dict[str, Any] | None:
    if not enabled:
        return None
    if config.draft_model is not None:
        return {"model": config.draft_model, "num_speculative_tokens": config.ngram_tokens}
    return {"method": "ngram", "num_speculative_tokens": config.ngram_tokens, **NGRAM_LOOKUP}


def kv_transfer_arguments(config: VllmEngineConfig, role: KvRole) -> dict[str, Any] | None:
    """vLLM's kv_transfer_config for the pool's KV connector and this worker's role; None without one.
    Pure."""
    if config.kv_connector is None:
        return None
    args: dict[str, Any] = {
        "kv_connector": config.kv_connector.connector,
        "kv_role": KV_CONNECTOR_ROLES[role],
        "kv_connector_extra_config": dict(config.kv_connector.extra),
        # KV that cannot be loaded (a prefill worker gone before the decode side pulled it) is computed
        # where the request decodes, never an error to the client.
        "kv_load_failure_policy": "recompute",
    }
    if config.kv_connector.connector == HANDOFF_CONNECTOR:
        args["kv_connector_module_path"] = HANDOFF_CONNECTOR_MODULE
    return args


def engine_arguments(
    pool: PoolConfig,
    model_dir: Path,
    spec_decoding: bool,
    kv_endpoint: str | None,
    on_gpu: bool = True,
    role: KvRole = "both",
) -> dict[str, Any]:
    """Keyword arguments for vLLM's AsyncEngineArgs, from the pool's configuration. Pure.

    `auto` precision is vLLM's choice on a GPU and float32 on a CPU: vLLM's own choice there is
    bfloat16, whose kernels use AVX512-BF16 and AMX instructions that a CPU may report but its virtual
    machine not enable (the engine's worker then dies of SIGILL on its first step)."""
    config = pool.vllm
    if config is None:
        raise StartFailed(f"pool {pool.name} has no [pools.vllm] section")
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": config.dtype if config.dtype != "auto" or on_gpu else "float32",
        "tensor_parallel_size": pool.tensor_parallel_size,
        "enable_prefix_caching": True,
        "block_size": pool.block_size,
        "max_model_len": pool.context_tokens,
        "max_num_seqs": pool.engine_slots,
        "scheduling_policy": config.scheduling_policy,
        "enforce_eager": config.enforce_eager,
        "kv_cache_memory_bytes": int(config.kv_cache_gib * (1 << 30)),
        "speculative_config": speculative_config(config, spec_decoding),
        "disable_log_stats": False,
    }
    if config.engine_traces_endpoint is not None:
        args["otlp_traces_endpoint"] = config.engine_traces_endpoint
    if not on_gpu and one_process_on_cpu(config, pool.tensor_parallel_size):
        args["distributed_executor_backend"] = "uni"
    if pool.adapters:
        args.update(lora_arguments(pool, on_gpu))
    transfer = kv_transfer_arguments(config, role)
    if transfer is not None:
        args["kv_transfer_config"] = transfer
        if role == "prefill":  # a prompt's KV is saved from one step: no prompt is split over steps
            args["max_num_batched_tokens"] = pool.context_tokens
    if kv_endpoint is not None:
        args["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_endpoint,
            "topic": KV_TOPIC.decode(),
        }
    return args


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def lora_arguments(pool: PoolConfig, on_gpu: bool) -> dict[str, Any]:
    """vLLM's LoRA settings for a pool with adapters: `max_loras` held at once (and as many kept in host
    memory, so an evicted adapter is read from its folder again), the rank rounded up to one vLLM
    accepts. On a CPU one slot more, for the base adapter (see `zero_adapter`). Pure."""
    rank = max(a.rank for a in pool.adapters)
    slots = pool.max_loras + (0 if on_gpu else 1)
    return {
        "enable_lora": True,
        "max_loras": slots,
        "max_cpu_loras": slots,
        "max_lora_rank": next(r for r in LORA_RANKS if r >= rank),
    }


def sampling_arguments(request: InferenceRequest) -> dict[str, Any]:
    """Keyword arguments for vLLM's SamplingParams (deltas, not cumulative text); `structured` is the
    guided-decoding constraint, given to vLLM as StructuredOutputsParams. Pure."""
    s = request.sampling
    structured: dict[str, Any] | None = None
    if s.structured is not None and s.structured.kind == "json_schema" and s.structured.schema_text:
        structured = {"json": json.loads(s.structured.schema_text)}
    elif s.structured is not None:
        structured = {"json_object": True}
    return {
        "structured": structured,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "stop": list(s.stop) or None,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
    }


def finish_reason(value: str | None) -> FinishReason:
    if value == "length":
        return FinishReason.LENGTH
    if value == "stop":
        return FinishReason.STOP
    raise RequestFailed(f"the engine ended the request ({value})")
