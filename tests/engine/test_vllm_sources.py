"""Weights from an object store (moto's S3 server on loopback), tensor parallelism, and a dead engine."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest

from gpu_workers.engine import EngineError
from gpu_workers.vllm_engine import VllmEngine
from infra.launcher import free_port, start_object_store
from plumbing.model_store import COMPLETE_MARK, ModelSourceError, ModelStore, cache_folder
from tests.engine.conftest import ENGINE_TIMEOUT, request_for, tiny_pool

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(ENGINE_TIMEOUT)]

BUCKET = "weights"
PREFIX = "tiny/llama"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = start_object_store(port, tmp_path_factory.mktemp("moto"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_factory(endpoint: str) -> Callable[[], Any]:
    def make() -> Any:
        return boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    return make


@pytest.fixture(scope="module")
def uploaded(s3_endpoint: str, tiny_llama: Path) -> str:
    client = s3_factory(s3_endpoint)()
    client.create_bucket(Bucket=BUCKET)
    for f in sorted(tiny_llama.iterdir()):
        client.upload_file(str(f), BUCKET, f"{PREFIX}/{f.name}")
    return f"s3://{BUCKET}/{PREFIX}"


def test_download_is_verified_reused_and_repaired(
    uploaded: str, s3_endpoint: str, tiny_llama: Path, tmp_path: Path
) -> None:
    store = ModelStore(tmp_path, s3_factory(s3_endpoint))
    with ThreadPoolExecutor(4) as pool:  # concurrent workers on one machine share one download
        folders = set(pool.map(lambda _: store.resolve(uploaded), range(4)))
    assert len(folders) == 1
    folder = folders.pop()
    assert (folder / COMPLETE_MARK).exists()
    assert (folder / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name], "no staging folder left behind"

    (folder / "model.safetensors").write_bytes(b"truncated")
    assert store.resolve(uploaded) == folder
    assert (folder / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()

    offline = ModelStore(tmp_path, s3_factory(f"http://127.0.0.1:{free_port()}"))
    assert offline.resolve(uploaded) == folder, "a complete download serves while the store is away"
    with pytest.raises(ModelSourceError, match="unreachable and nothing is cached"):
        ModelStore(tmp_path / "empty", s3_factory(f"http://127.0.0.1:{free_port()}")).resolve(uploaded)
    with pytest.raises(ModelSourceError, match="no objects under this prefix"):
        store.resolve(f"s3://{BUCKET}/nothing-here")


def test_only_tokenizer_files_for_the_ingress(uploaded: str, s3_endpoint: str, tmp_path: Path) -> None:
    folder = ModelStore(tmp_path, s3_factory(s3_endpoint)).resolve(
        uploaded, only=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
    )
    assert (folder / "tokenizer.json").exists()
    assert not (folder / "model.safetensors").exists()
    assert folder != cache_folder(tmp_path, uploaded)


def _engine_children() -> list[int]:
    """Pids of this process's children that run vLLM's engine core (not multiprocessing's helpers)."""
    me = str(os.getpid())
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        # The module's object store is a child too, and is spared.
        if fields[1] == me and b"resource_tracker" not in cmdline and b"moto_server" not in cmdline:
            children.append(int(stat.parent.name))
    return children


@pytest.mark.asyncio
async def test_served_from_s3_then_a_dead_engine_is_reported(
    uploaded: str, s3_endpoint: str, tmp_path: Path
) -> None:
    engine = VllmEngine(
        tiny_pool(uploaded), ModelStore(tmp_path, s3_factory(s3_endpoint)), spec_decoding=False
    )
    await engine.start()
    try:
        outs = [o async for o in engine.generate(request_for([10, 11, 12], max_tokens=6))]
        assert sum(o.num_tokens for o in outs) == 6
        assert engine.failure() is None

        stream = engine.generate(request_for([10, 11, 13], max_tokens=1900, rid="crash-000000000000001"))
        await stream.__anext__()
        before = set(_engine_children())
        assert before, "vLLM's engine core runs in a child process"
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"died|failed"):
            async for _ in stream:
                pass
        for _ in range(50):
            if engine.failure() is not None:
                break
            await asyncio.sleep(0.1)
        assert "died" in (engine.failure() or "")
    finally:
        await engine.close()


@pytest.mark.asyncio
async def test_tensor_parallel_two_serves_a_request(tiny_llama: Path, tmp_path: Path) -> None:
    engine = VllmEngine(
        tiny_pool(str(tiny_llama), tensor_parallel_size=2), ModelStore(tmp_path), spec_decoding=False
    )
    await engine.start()
    try:
        outs = [o async for o in engine.generate(request_for([10, 11, 12], max_tokens=8))]
        assert sum(o.num_tokens for o in outs) == 8
        assert outs[-1].finish_reason is not None
    finally:
        await engine.close()


def test_object_keys_that_leave_the_model_folder_refuse_the_source(s3_endpoint: str, tmp_path: Path) -> None:
    client = s3_factory(s3_endpoint)()
    client.create_bucket(Bucket="hostile")
    cache = tmp_path / "cache"
    cache.mkdir()
    for bad in ("../../escaped.txt", "/absolute.txt", "a/./b.txt"):
        prefix = f"p{abs(hash(bad)) % 10_000}"
        client.put_object(Bucket="hostile", Key=f"{prefix}/config.json", Body=b"{}")
        client.put_object(Bucket="hostile", Key=f"{prefix}/{bad}", Body=b"pwned")
        assert f"{prefix}/{bad}" in [o["Key"] for o in client.list_objects_v2(Bucket="hostile")["Contents"]]
        with pytest.raises(ModelSourceError, match="does not name a file inside the model folder"):
            ModelStore(cache, s3_factory(s3_endpoint)).resolve(f"s3://hostile/{prefix}")
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == b"pwned"]
