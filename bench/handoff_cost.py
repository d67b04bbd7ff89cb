"""What a prefill/decode handoff costs on this machine's CPU: SmolLM2-135M-Instruct on vLLM, the
sluice handoff connector writing and reading the shared folder (a local disk here).

Three engines in turn, each in its own process with one OpenMP thread bound to core 0, over the same
prompts of several lengths:
- single: an engine without a connector; its time to first token is a local prefill;
- prefill: the prefill worker's job, one token with the KV saved (time, and bytes written per token);
- decode: an engine that loads that KV; its time to first token is the handoff's load plus one step.

Each prompt is run `--rounds` times (a fresh handoff id, and a fresh prompt per round, so no local prefix
cache helps); the medians are printed. What it costs here, on a CPU and a local disk: not a claim about
GPUs, where NIXL moves KV between GPU memories over RDMA.

Run: `.venv/bin/python -m bench.handoff_cost` (SmolLM2 is prepared in .sluice/models on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_workers.handoff import KvTransfer, kv_folder
from gpu_workers.vllm_engine import VllmEngine
from infra.models import prepare_smollm2
from plumbing.model_store import ModelStore
from queue_schemas.config import HANDOFF_CONNECTOR, KvConnectorConfig, PoolConfig, VllmEngineConfig
from queue_schemas.messages import InferenceRequest, KvRole, SamplingParams

MODELS = Path(".sluice/models")


def pool(source: Path, storage: Path | None) -> PoolConfig:
    connector = (
        None
        if storage is None
        else KvConnectorConfig(connector=HANDOFF_CONNECTOR, extra={"shared_storage_path": str(storage)})
    )
    engine = VllmEngineConfig(
        source=str(source), kv_cache_gib=0.5, max_num_seqs=4, cpu_threads=1, kv_connector=connector
    )
    return PoolConfig(
        name="bench", model="bench", engine="vllm", block_size=128, context_tokens=4096, vllm=engine
    )


def request(tokens: list[int], max_tokens: int, n: int) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"bench-{n:012d}", pool="bench", model="bench", team="t", prompt_token_ids=tuple(tokens),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), created_at=0.0, deadline=1e12,
    )  # fmt: skip


def prompt(length: int, seed: int) -> list[int]:
    return [(i * 31 + seed * 977) % 20000 + 100 for i in range(length)]


async def first_token_s(engine: VllmEngine, req: InferenceRequest, kv: KvTransfer | None) -> float:
    t0 = time.perf_counter()
    async for _ in engine.generate(req, kv):
        return time.perf_counter() - t0
    raise AssertionError("no output")


PHASES: dict[str, tuple[bool, KvRole]] = {
    "single": (False, "both"),
    "prefill": (True, "prefill"),
    "decode": (True, "decode"),
}


def handoff_id(n: int, r: int) -> str:
    """The same handoff id in the prefill and the decode phase (each phase runs in its own process)."""
    return hashlib.sha256(f"{n}:{r}".encode()).hexdigest()[:32]


async def phase(name: str, source: Path, storage: Path, lengths: list[int], rounds: int) -> dict[str, Any]:
    """One engine, started in this process for this phase alone; first-token seconds per prompt length."""
    connected, role = PHASES[name]
    engine = VllmEngine(
        pool(source, storage if connected else None), ModelStore(MODELS / "cache"), False, role
    )
    await engine.start()
    seconds: dict[int, list[float]] = {}
    sizes: dict[int, list[float]] = {}
    try:
        for n in lengths:
            for r in range(rounds + 1):  # round 0 warms up
                kv = None if name == "single" else KvTransfer(handoff_id(n, r), save=name == "prefill")
                req = request(prompt(n, r), 1 if name == "prefill" else 2, n * 100 + r)
                took = await first_token_s(engine, req, kv)
                if not r:
                    continue
                seconds.setdefault(n, []).append(took)
                if name == "prefill":
                    written = sum(f.stat().st_size for f in kv_folder(storage, handoff_id(n, r)).iterdir())
                    sizes.setdefault(n, []).append(written / n)
    finally:
        await engine.close()
    return {"seconds": seconds, "sizes": sizes}


def run_phase(name: str, storage: Path, lengths: list[int], rounds: int) -> dict[str, Any]:
    """`phase` in a fresh process: the engines' thread settings do not carry over from one to the next."""
    argv = [sys.executable, "-m", "bench.handoff_cost", "--phase", name, "--storage", str(storage)]
    argv += ["--rounds", str(rounds), "--lengths", *map(str, lengths)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}  # every phase on the same one core
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def report(results: dict[str, dict[str, Any]], lengths: list[int]) -> None:
    print(
        "| prompt tokens | local prefill (TTFT) s | prefill job s | decode with the KV loaded (TTFT) s "
        "| KV written, KiB per token |"
    )
    print("| --- | --- | --- | --- | --- |")
    for n in lengths:
        med = {name: statistics.median(results[name]["seconds"][str(n)]) for name in PHASES}
        size = statistics.median(results["prefill"]["sizes"][str(n)]) / 1024
        print(f"| {n} | {med['single']:.3f} | {med['prefill']:.3f} | {med['decode']:.3f} | {size:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 3968])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--storage", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = prepare_smollm2(MODELS / "smollm2-135m-instruct", MODELS / "downloads").resolve()
    if args.phase is not None:
        print(json.dumps(asyncio.run(phase(args.phase, source, args.storage, args.lengths, args.rounds))))
        return
    with tempfile.TemporaryDirectory(prefix="handoff-") as storage:
        results = {name: run_phase(name, Path(storage), args.lengths, args.rounds) for name in PHASES}
    report(results, args.lengths)


if __name__ == "__main__":
    main()
