"""The file store of /v1/files: a local folder and S3 (moto's server on loopback), the same contract."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from infra.launcher import free_port, start_object_store
from ingress.batches.object_store import LocalStore, ObjectStore, StoreUnavailable, object_store

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def s3_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Any]]:
    port = free_port()
    server = start_object_store(port, tmp_path_factory.mktemp("moto"))

    def make() -> Any:
        return boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
        )  # fmt: skip

    make().create_bucket(Bucket="files")
    try:
        yield make
    finally:
        server.stop()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, s3_factory: Callable[[], Any]) -> ObjectStore:
    if request.param == "local":
        return object_store(str(tmp_path / "files"))
    return object_store("s3://files/sluice", s3_factory)


async def test_put_get_delete(store: ObjectStore) -> None:
    await store.put("files/acme/file-1", b'{"a": 1}\n')
    await store.put("files/acme/file-1", b'{"a": 2}\n')  # a second put replaces the object whole
    assert await store.get("files/acme/file-1") == b'{"a": 2}\n'
    await store.delete("files/acme/file-1")
    with pytest.raises(FileNotFoundError):
        await store.get("files/acme/file-1")
    await store.delete("files/acme/file-1")  # deleting what is gone is not an error
    with pytest.raises(FileNotFoundError):
        await store.get("files/beta/never")


async def test_a_local_key_cannot_leave_the_folder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "files")
    with pytest.raises(ValueError, match="leaves the store"):
        await store.put("../outside", b"x")
    assert not (tmp_path / "outside").exists()


async def test_a_file_is_stored_from_a_stream_and_read_back_in_ranges(store: ObjectStore) -> None:
    data = b"".join(f'{{"line": {n}}}\n'.encode() for n in range(10_000))
    await store.put_file("files/acme/big", io.BytesIO(data))
    assert await store.get("files/acme/big") == data
    assert await store.read_range("files/acme/big", 0, 13) == data[:13]
    assert await store.read_range("files/acme/big", 1000, 5000) == data[1000:6000]
    assert await store.read_range("files/acme/big", len(data) - 4, 100) == data[-4:]
    assert await store.read_range("files/acme/big", len(data), 100) == b""
    with pytest.raises(FileNotFoundError):
        await store.read_range("files/acme/none", 0, 10)


async def test_an_s3_store_that_does_not_answer_is_an_outage() -> None:
    """Every call to an unreachable S3 endpoint raises StoreUnavailable, an OSError: callers retry it as
    they retry a full disk, and never take it for a fault of the object."""
    port = free_port()  # nothing listens here

    def make() -> Any:
        return boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
            config=Config(connect_timeout=1, read_timeout=1, retries={"max_attempts": 1}),
        )  # fmt: skip

    store = object_store("s3://files/sluice", make)
    for call in (
        store.get("files/acme/x"),
        store.read_range("files/acme/x", 0, 10),
        store.put("files/acme/x", b"x"),
        store.put_file("files/acme/x", io.BytesIO(b"x")),
        store.delete("files/acme/x"),
    ):
        with pytest.raises(StoreUnavailable):
            await call
    assert issubclass(StoreUnavailable, OSError)
