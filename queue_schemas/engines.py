"""The engines a pool may run and what each can do, in one place: the services ask this table, never an
engine's name (gpu_workers.engines maps each name to its class)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EngineName = Literal["simulated", "vllm"]


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: EngineName
    # Structured-output schemas are compiled with xgrammar, as vLLM does; ingress and batch intake check
    # them the same way before queueing, so a schema the engine refuses is a 400, not an engine error.
    compiles_schemas: bool
    # Prompts are tokenized with the model's own tokenizer (the simulated engine counts UTF-8 bytes).
    model_tokenizer: bool
    # Its settings live in the pool's [pools.vllm] section (source, max_num_seqs, KV connector).
    vllm_section: bool


ENGINES: dict[str, EngineKind] = {
    "simulated": EngineKind("simulated", compiles_schemas=False, model_tokenizer=False, vllm_section=False),
    "vllm": EngineKind("vllm", compiles_schemas=True, model_tokenizer=True, vllm_section=True),
}


def engine_kind(name: str) -> EngineKind:
    return ENGINES[name]
