"""What a prefill/decode handoff costs on this machine's CPU: SmolLM2-135M-Instruct on vLLM, the
sluice handoff connector writing and reading the shared folder (a local disk here).

Three engines in turn, each with one OpenMP thread, over the same prompts of several lengths:
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
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from gpu_workers.handoff import KvTransfer, kv_folder
from gpu_workers.vllm_engine import VllmEngine
from infra.models import prepare_smollm2
from queue_schemas.config import HANDOFF_CONNECTOR, KvConnectorConfig, PoolConfig, VllmEngineConfig
from queue_schemas.messages import InferenceRequest, KvRole, SamplingParams
from queue_schemas.model_store import ModelStore

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


async def measure(source: Path, lengths: list[int], rounds: int) -> None:
    storage = Path(tempfile.mkdtemp(prefix="handoff-"))
    cache = MODELS / "cache"
    prompts = {(n, r): prompt(n, r) for n in lengths for r in range(rounds + 1)}  # round 0 warms up
    ids = {key: secrets.token_hex(16) for key in prompts}
    results: dict[str, dict[int, list[float]]] = {"single": {}, "prefill": {}, "decode": {}}
    sizes: dict[int, list[float]] = {}
    count = 0
    phases: list[tuple[str, Path | None, KvRole]] = [
        ("single", None, "both"), ("prefill", storage, "prefill"), ("decode", storage, "decode"),
    ]  # fmt: skip
    for phase, folder, role in phases:
        engine = VllmEngine(pool(source, folder), ModelStore(cache), False, role)
        await engine.start()
        try:
            for (n, r), tokens in prompts.items():
                count += 1
                kv = None if phase == "single" else KvTransfer(ids[n, r], save=phase == "prefill")
                seconds = await first_token_s(
                    engine, request(tokens, 1 if phase == "prefill" else 2, count), kv
                )
                if r:
                    results[phase].setdefault(n, []).append(seconds)
                if phase == "prefill" and r:
                    written = sum(f.stat().st_size for f in kv_folder(storage, ids[n, r]).iterdir())
                    sizes.setdefault(n, []).append(written / n)
        finally:
            await engine.close()
    print("| prompt tokens | local prefill (TTFT) s | prefill job s | decode with the KV loaded (TTFT) s "
          "| KV written, KiB per token |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for n in lengths:
        med = {phase: statistics.median(results[phase][n]) for phase in results}
        print(
            f"| {n} | {med['single']:.3f} | {med['prefill']:.3f} | {med['decode']:.3f} "
            f"| {statistics.median(sizes[n]) / 1024:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 3968])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = prepare_smollm2(MODELS / "smollm2-135m-instruct", MODELS / "downloads").resolve()
    asyncio.run(measure(source, args.lengths, args.rounds))


if __name__ == "__main__":
    main()
