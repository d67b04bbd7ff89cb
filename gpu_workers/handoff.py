"""The worker's side of a prefill/decode handoff that needs no engine: what the KV connector is asked to
do for a request, where the shared-storage connector keeps a handoff's KV, and how that is removed."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HANDOFF_PARAM = "sluice_handoff"
_HANDOFF_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """A request's part in a handoff: the prefill side saves the prompt's KV, the decode side loads it.
    `remote`: for a connector that moves KV between engines (NIXL, Mooncake), the parameters the prefill
    engine returned with its output, which tell the decode engine where to pull the KV from."""

    handoff_id: str
    save: bool
    remote: dict[str, Any] | None = None


def transfer_params(kv: KvTransfer, shared_storage: bool = True) -> dict[str, Any]:
    """The request's kv_transfer_params. Pure.

    sluice's shared-storage connector (gpu_workers.kv_handoff) takes the handoff id and the side. The
    engine-to-engine connectors of vLLM take `do_remote_decode` on the prefill side, and on the decode
    side the prefill's returned parameters with `do_remote_prefill`."""
    if shared_storage:
        return {HANDOFF_PARAM: kv.handoff_id, "save" if kv.save else "load": True}
    if kv.save:
        return {"do_remote_decode": True, "do_remote_prefill": False}
    return {**(kv.remote or {}), "do_remote_prefill": True, "do_remote_decode": False}


def parse_params(params: dict[str, Any] | None) -> KvTransfer | None:
    """The handoff a request's kv_transfer_params ask for; None for anything else. Pure."""
    if not params:
        return None
    handoff_id = params.get(HANDOFF_PARAM)
    if not isinstance(handoff_id, str) or not _HANDOFF_ID.match(handoff_id):
        return None
    if params.get("save") is True:
        return KvTransfer(handoff_id, True)
    if params.get("load") is True:
        return KvTransfer(handoff_id, False)
    return None


def kv_folder(storage: Path, handoff_id: str) -> Path:
    """Where the shared-storage connector writes a handoff's KV (one file per layer)."""
    if not _HANDOFF_ID.match(handoff_id):
        raise ValueError(f"not a handoff id: {handoff_id!r}")
    return storage / handoff_id


def remove_kv(storage: Path, handoff_id: str) -> bool:
    """Remove a handoff's KV; whether there was any."""
    folder = kv_folder(storage, handoff_id)
    existed = folder.exists()
    shutil.rmtree(folder, ignore_errors=True)
    return existed


def sweep(storage: Path, older_than_s: float, now: float | None = None) -> int:
    """Remove handoff KV folders last written more than `older_than_s` ago (a decode worker that fell
    back, or died, never removed them). Returns how many were removed."""
    now = time.time() if now is None else now
    removed = 0
    if not storage.is_dir():
        return 0
    for folder in storage.iterdir():
        if not folder.is_dir() or not _HANDOFF_ID.match(folder.name):
            continue
        try:
            age = now - folder.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > older_than_s:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


class PrefillRate:
    """Prompt tokens a worker computes per second, from its prefill jobs (an exponential average of
    tokens over seconds per job). Pure."""

    def __init__(self, weight: float = 0.3) -> None:
        self._weight = weight
        self.tokens_per_s = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        w = self._weight
        self.tokens_per_s = rate if self.tokens_per_s == 0 else (1 - w) * self.tokens_per_s + w * rate
