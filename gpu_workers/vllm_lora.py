"""LoRA adapters on vLLM: checking an adapter's files against its pool, and the all-zero adapter a CPU
worker runs base-model requests under."""

from __future__ import annotations

import json
from pathlib import Path

from plumbing.model_store import ModelSourceError
from queue_schemas.config import (
    AdapterConfig,
)


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
