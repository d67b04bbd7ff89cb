"""The pool configuration file: which models are served, by which engine, with which limits.

One TOML file describes every pool; every service reads the same file.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from queue_schemas.engines import EngineKind, EngineName, engine_kind
from queue_schemas.messages import Name

DEFAULT_CONFIG = "default_pools.toml"


class SimulatedEngineConfig(BaseModel):
    """Timing of the simulated engine: no model, deterministic text, real KV block accounting."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timing: Literal["per_request", "batched"] = Field(
        default="per_request",
        description="per_request: each request sleeps its own TTFT and token times; batched: engine steps "
        "shared by all running requests (gpu_workers/batch_clock.py, the fleet simulator's model)",
    )
    scheduling: Literal["priority", "fcfs"] = Field(
        default="priority",
        description="as vLLM's scheduling_policy: priority serves lower engine priorities first and "
        "preempts the lowest when KV blocks run out; fcfs serves arrivals in order",
    )
    ttft_ms: float = Field(default=40.0, ge=0.0, description="fixed cost of a prefill")
    prefill_ms_per_token: float = Field(default=0.002, ge=0.0, description="prefill cost per uncached token")
    token_ms: float = Field(default=8.0, ge=0.0)
    step_ms: float = Field(default=15.0, gt=0.0, description="batched: fixed cost of one engine step")
    step_ms_per_seq: float = Field(
        default=0.15, ge=0.0, description="batched: step cost per decoding sequence"
    )
    chunk_tokens: int = Field(default=2048, gt=0, description="batched: prompt tokens prefilled per step")
    kv_blocks: int = Field(default=4096, gt=0)
    max_running: int = Field(default=64, gt=0)
    adapter_load_ms: float = Field(default=200.0, ge=0.0, description="loading a LoRA adapter not held")
    min_words: int = Field(default=12, gt=0, description="shortest natural answer, in words")
    max_words: int = Field(default=40, gt=0, description="longest natural answer, in words")
    fail_after_tokens: int | None = Field(
        default=None, ge=0, description="fault injection: fail every request after this many tokens"
    )
    fault_kind: Literal["engine", "bug"] = Field(
        default="engine",
        description="what fail_after_tokens raises: an engine error, or an unexpected exception (a bug)",
    )
    die_after_tokens: int | None = Field(
        default=None, ge=0, description="fault injection: the whole engine dies after this many tokens"
    )

    @model_validator(mode="after")
    def _word_range(self) -> Self:
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) exceeds max_words ({self.max_words})")
        return self


# sluice's shared-storage connector (the worker's handoff connector): vLLM's ExampleConnector, saving and
# loading only handoffs, each under its own secret id.
HANDOFF_CONNECTOR = "SluiceHandoffConnector"
KV_CONNECTOR_ROLES: dict[str, str] = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}


class KvConnectorConfig(BaseModel):
    """vLLM's KV connector, through which one engine's prefill reaches another engine's decode.

    `ExampleConnector` (vLLM's shared-storage connector: one file per layer under a folder named by the
    prompt's hash) runs on CPU and is what the dev stack and the tests use; GPU deployments name another
    connector of vLLM's (NixlConnector, LMCacheConnectorV1, MooncakeConnector) with its own settings.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    connector: str = Field(default="ExampleConnector", min_length=1, max_length=64)
    extra: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="the connector's own settings (kv_connector_extra_config), e.g. shared_storage_path",
    )


class VllmEngineConfig(BaseModel):
    """How a worker starts vLLM for the pool. The pool's block_size must equal vLLM's (128 on CPU)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(
        min_length=1,
        description="`s3://bucket/prefix`, a local model folder, or a model hub id where a hub is reachable",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="auto: vLLM's choice on a GPU, float32 on a CPU (bfloat16 there needs CPU features "
        "some virtual machines do not enable)",
    )
    kv_cache_gib: float = Field(default=1.0, gt=0, description="KV cache size per worker, in GiB")
    max_num_seqs: int = Field(default=32, gt=0, description="requests the engine runs at once")
    scheduling_policy: Literal["priority", "fcfs"] = Field(
        default="priority",
        description="priority: vLLM serves lower engine priorities first (interactive tiers, then batch) "
        "and preempts the lowest when KV blocks run out; fcfs: arrival order",
    )
    enforce_eager: bool = Field(default=True, description="skip graph capture (faster start, CPU default)")
    cpu_threads: int | None = Field(default=None, gt=0, description="OpenMP threads per rank on CPU")
    ngram_tokens: int = Field(default=3, gt=0, description="tokens proposed per step by ngram speculation")
    draft_model: str | None = Field(
        default=None, description="a draft model folder for speculation instead of ngram (GPU pools)"
    )
    kv_connector: KvConnectorConfig | None = Field(
        default=None, description="a KV connector, for prefill on one worker and decode on another"
    )
    engine_traces_endpoint: str | None = Field(
        default=None,
        max_length=512,
        description="an OTLP endpoint for vLLM's own engine spans (its otlp_traces_endpoint); each "
        "request's trace context goes with it, so the engine's spans join the request's trace",
    )

    @property
    def handoff_storage(self) -> Path | None:
        """The folder handoff KV is written to, with the sluice shared-storage connector."""
        kv = self.kv_connector
        if kv is None or kv.connector != HANDOFF_CONNECTOR:
            return None
        path = kv.extra.get("shared_storage_path")
        return Path(str(path)) if path else None


# What clients send as `model`: a base model's or an adapter's id.
ModelId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/\-]{0,127}$")]


class AdapterConfig(BaseModel):
    """A LoRA adapter of the pool's base model, served as its own model id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ModelId = Field(description="the model id clients send for this adapter")
    source: str = Field(
        min_length=1,
        description="`s3://bucket/prefix`, a local folder or a hub id holding adapter_config.json and "
        "adapter_model.safetensors (PEFT's layout)",
    )
    rank: int = Field(default=8, gt=0, le=512, description="the adapter's LoRA rank (r)")
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "v_proj"), min_length=1, description="the modules it adapts, for `sluice plan`"
    )


class PrefillGroup(BaseModel):
    """A pool's prefill-only workers (role `prefill`): they run disaggregated requests' prompts and hand
    the KV to the pool's other workers (then role `decode`), which run every request's decode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=2, ge=0)
    per_decode: float = Field(
        default=1.0, gt=0, description="prefill replicas per decode replica the scaler targets, within bounds"
    )

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"prefill min_replicas ({self.min_replicas}) exceeds max_replicas")
        return self


class DisaggregationConfig(BaseModel):
    """When the dispatcher runs a request's prefill on a prefill worker and its decode on another.

    `auto` decides per request (dispatcher.disagg): when the decode worker's time to prefill the
    uncached prompt, and the stall it would put on that worker's running requests, exceed the prefill
    worker's queue and compute plus the KV transfer. `threshold` is llm-d's rule (uncached prompt tokens
    at least `threshold_tokens`); `always` and `never` are what they say.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["auto", "threshold", "always", "never"] = "auto"
    threshold_tokens: int = Field(
        default=500, ge=0, description="mode threshold: uncached tokens to split at"
    )
    min_uncached_tokens: int = Field(
        default=256, ge=1, description="auto: a shorter uncached prompt always prefills where it decodes"
    )
    transfer_fixed_s: float = Field(default=0.05, ge=0, description="a handoff's fixed cost, until measured")
    transfer_s_per_token: float = Field(default=0.0, ge=0, description="KV transfer time per prompt token")
    prefill_tokens_per_s: float = Field(
        default=2000.0, gt=0, description="a worker's prefill rate until its heartbeat reports one"
    )
    stall_weight: float = Field(
        default=1.0,
        ge=0,
        description="auto: how much a second of prefill stalling one running request counts against TTFT",
    )
    handoff_wait_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="a decode worker prefills itself if the KV is not ready by then",
    )
    kv_ttl_s: float = Field(
        default=300.0, gt=0, description="handoff KV left on shared storage is removed after"
    )


class ScalingConfig(BaseModel):
    """How the scaler sizes the pool (validated again as a policy when the scaler starts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=0, description="0 disables the pool: no worker will serve it")
    scale_to_zero: bool = False
    requests_per_replica_s: float = Field(default=4.0, gt=0, description="capacity until one is measured")
    startup_s: float = Field(default=180.0, gt=0, description="replica start-up time until one is measured")
    queue_slo_s: float = Field(default=30.0, gt=0, description="a backlog is drained within this")
    target_utilization: float = Field(default=0.9, gt=0, le=1)
    cooldown_s: float = Field(default=300.0, ge=0)
    step_down_every_s: float = Field(default=60.0, ge=0)
    spec_decoding: Literal["on", "off", "auto"] = "off"
    plan_model: str | None = Field(
        default=None, description="take the capacity default from `sluice plan` for this model preset"
    )
    plan_gpu: str = "h100"
    plan_tensor_parallel: int = Field(default=4, gt=0)
    prefill: PrefillGroup | None = Field(
        default=None, description="prefill-only workers; with them, the replicas above are decode workers"
    )

    @property
    def can_activate(self) -> bool:
        """Whether a request may wait for a replica to start when none is up."""
        return self.max_replicas > 0 and (self.min_replicas > 0 or self.scale_to_zero)


class LatencyConfig(BaseModel):
    """The pool's latency targets and the latency model's priors (plumbing.latency), until its workers
    report their own figures."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_slo_ms: int = Field(
        default=2000, gt=0, le=600_000, description="time to first token, for a request that states none"
    )
    tpot_slo_ms: int = Field(
        default=100, gt=0, le=600_000, description="time per output token, for a request that states none"
    )
    slo_hold_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="how long an interactive request no worker can serve within its TTFT SLO is held for "
        "one that can (0: placed at once where predicted soonest)",
    )
    prefill_tokens_per_s: float = Field(
        default=8000.0, gt=0, description="prior: prompt tokens a worker computes per second"
    )
    step_ms: float = Field(default=30.0, gt=0, description="prior: a decode step")


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Name
    model: str = Field(min_length=1, description="the model name clients send")
    engine: EngineName = "simulated"
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        description="`bytes` (UTF-8 bytes as token ids, the simulated engine's own), a model folder or "
        "`s3://` prefix holding tokenizer.json and a chat template; unset: the engine's own "
        "(`bytes` for the simulated engine, the model's files for vLLM)",
    )
    context_tokens: int = Field(default=8192, gt=0)
    default_max_tokens: int = Field(default=256, gt=0)
    block_size: int = Field(default=16, gt=0)
    partitions: int = Field(default=4, gt=0)
    tensor_parallel_size: int = Field(default=1, gt=0)
    max_queued: int = Field(
        default=2000,
        gt=0,
        description="admission refuses new requests while the lag (held ones included) reaches this",
    )
    queue_timeout_s: float = Field(default=120.0, gt=0, description="a request not started by then times out")
    light_slots: int = Field(
        default=2,
        ge=0,
        description="running slots each worker keeps beyond its engine's stated slots for interactive "
        "requests of teams running less than an equal share of that worker, so a light team does not "
        "wait for a heavy one's request to finish; the engine is sized for both",
    )
    max_migrations: int = Field(
        default=3,
        ge=0,
        description="how many times a request may move to another worker after losing its own; past it "
        "the request ends with worker_lost",
    )
    resume_grace_s: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="how long a streamed request whose client dropped keeps running for the client to "
        "come back (ingress.resume); 0: cancelled at once",
    )
    shared_prefix_cache: bool = Field(
        default=False,
        description="let teams reuse each other's cached prefixes (a public system prompt, say); then a "
        "team can tell from cached_tokens or timing that another team recently sent the same prefix",
    )
    adapters: tuple[AdapterConfig, ...] = Field(
        default=(), description="LoRA adapters of the base model, each served as its own model id"
    )
    max_loras: int = Field(
        default=4, gt=0, description="adapters a worker holds at once; the least recently used is evicted"
    )
    simulated: SimulatedEngineConfig = SimulatedEngineConfig()
    vllm: VllmEngineConfig | None = None
    scaling: ScalingConfig = ScalingConfig()
    latency: LatencyConfig = LatencyConfig()
    disaggregation: DisaggregationConfig | None = Field(
        default=None, description="prefill on prefill workers, decode on the others (needs scaling.prefill)"
    )

    @model_validator(mode="after")
    def _roles(self) -> Self:
        split = self.disaggregation is not None and self.disaggregation.mode != "never"
        if split and self.scaling.prefill is None:
            raise ValueError(
                f"pool {self.name}: [pools.disaggregation] needs [pools.scaling.prefill] workers"
            )
        if split and self.kind.vllm_section and (self.vllm is None or self.vllm.kv_connector is None):
            raise ValueError(f"pool {self.name}: disaggregation on vLLM needs [pools.vllm.kv_connector]")
        if split and self.adapters:
            raise ValueError(f"pool {self.name}: disaggregation is for base-model pools (no adapters)")
        return self

    @property
    def kind(self) -> EngineKind:
        """What the pool's engine can do."""
        return engine_kind(self.engine)

    @property
    def splits(self) -> bool:
        """Whether the dispatcher may run a request's prefill on a prefill worker."""
        return self.disaggregation is not None and self.disaggregation.mode != "never"

    @model_validator(mode="after")
    def _engine_section(self) -> Self:
        if self.kind.vllm_section and self.vllm is None:
            raise ValueError(
                f"pool {self.name}: engine = '{self.engine}' needs a [pools.vllm] section with `source`"
            )
        if self.kind.model_tokenizer and self.tokenizer == "bytes":
            raise ValueError(
                f"pool {self.name}: a vLLM pool tokenizes with its model's tokenizer, not `bytes`"
            )
        return self

    @model_validator(mode="after")
    def _adapter_names(self) -> Self:
        names = [a.name for a in self.adapters]
        repeated = sorted({n for n in names if names.count(n) > 1 or n == self.model})
        if repeated:
            raise ValueError(
                f"pool {self.name}: adapter names repeat or equal the model: {', '.join(repeated)}"
            )
        return self

    def adapter(self, name: str) -> AdapterConfig | None:
        return next((a for a in self.adapters if a.name == name), None)

    def adapter_id(self, name: str) -> int:
        """The adapter's number in the engine (vLLM's lora_int_id): its place in the list, from 1."""
        return next(i for i, a in enumerate(self.adapters, 1) if a.name == name)

    @property
    def tokenizer_source(self) -> str:
        """Where prompts are tokenized from: `bytes`, a folder, or an `s3://` prefix."""
        if self.tokenizer is not None:
            return self.tokenizer
        return self.vllm.source if self.vllm is not None and self.kind.model_tokenizer else "bytes"

    @property
    def max_running(self) -> int:
        return (
            self.vllm.max_num_seqs
            if self.vllm is not None and self.kind.vllm_section
            else self.simulated.max_running
        )

    @property
    def engine_slots(self) -> int:
        """Sequences the engine is built to run at once: the stated slots and the light ones."""
        return self.max_running + self.light_slots


class SluiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pools: tuple[PoolConfig, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        for attr in ("name", "model"):
            values = [getattr(p, attr) for p in self.pools]
            duplicated = sorted({v for v in values if values.count(v) > 1})
            if duplicated:
                raise ValueError(f"pool {attr}s must be unique; repeated: {', '.join(duplicated)}")
        ids = [p.model for p in self.pools] + [a.name for p in self.pools for a in p.adapters]
        shared = sorted({i for i in ids if ids.count(i) > 1})
        if shared:
            raise ValueError(f"model ids (models and adapters) must be unique; repeated: {', '.join(shared)}")
        return self

    def pool_for_model(self, model: str) -> PoolConfig | None:
        """The pool serving `model`, a base model's id or one of its adapters'."""
        return next((p for p in self.pools if p.model == model or p.adapter(model) is not None), None)

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool named {name!r}; configured: {', '.join(p.name for p in self.pools)}")


class ConfigError(ValueError):
    """The configuration file is missing or invalid; the message says where."""


def parse_config(text: str, source: str = "<string>") -> SluiceConfig:
    try:
        return SluiceConfig.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: Path | None) -> SluiceConfig:
    """Read the pool file at `path`, or the packaged default (one simulated pool) when None."""
    if path is None:
        text = resources.files("queue_schemas").joinpath(DEFAULT_CONFIG).read_text()
        return parse_config(text, DEFAULT_CONFIG)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read pool configuration {path}: {exc.strerror}") from None
    return parse_config(text, str(path))
