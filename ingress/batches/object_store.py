"""Where uploaded and result files live: a local folder, or S3 (`s3://bucket/prefix`, boto3 with the usual
AWS settings; AWS_ENDPOINT_URL_S3 names another S3-compatible store). Both run their blocking calls in a
thread, so the event loop never waits on the disk or the network."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from plumbing.model_store import default_s3_client, parse_s3

COPY_PIECE = 1024 * 1024


class StoreUnavailable(OSError):
    """The store did not do what was asked for a reason of its own (unreachable, throttling, refusing):
    an outage, as an OSError is for a local folder, never a fault of the object asked for."""


class ObjectStore(Protocol):
    async def put(self, key: str, data: bytes) -> None: ...

    async def put_file(self, key: str, stream: BinaryIO) -> None:
        """Store what `stream` holds from its current position, read in pieces (never whole)."""
        ...

    async def read_range(self, key: str, start: int, size: int) -> bytes:
        """Up to `size` bytes from `start`; FileNotFoundError when there is no object."""
        ...

    async def get(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        ...

    async def delete(self, key: str) -> None: ...


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"object key {key!r} leaves the store")
        return path

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, self._path(key), data)

    @staticmethod
    def _put(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # readers see the whole object or none

    async def put_file(self, key: str, stream: BinaryIO) -> None:
        await asyncio.to_thread(self._put_file, self._path(key), stream)

    @staticmethod
    def _put_file(path: Path, stream: BinaryIO) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with tmp.open("wb") as out:
            shutil.copyfileobj(stream, out, COPY_PIECE)
        os.replace(tmp, path)

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._path(key).read_bytes)

    async def read_range(self, key: str, start: int, size: int) -> bytes:
        return await asyncio.to_thread(self._read_range, self._path(key), start, size)

    @staticmethod
    def _read_range(path: Path, start: int, size: int) -> bytes:
        with path.open("rb") as f:
            f.seek(start)
            return f.read(size)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, missing_ok=True)


class S3Store:
    def __init__(
        self, bucket: str, prefix: str, client_factory: Callable[[], Any] = default_s3_client
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self._client = client_factory()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(
            self._call, self._client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data
        )

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._get, self._key(key))

    def _get(self, key: str, byte_range: str | None = None) -> bytes:
        extra = {"Range": byte_range} if byte_range else {}
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=key, **extra)
            body: bytes = reply["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            if code == "InvalidRange":
                return b""  # from the end on: nothing
            raise StoreUnavailable(f"the object store failed: {type(exc).__name__} {code or ''}") from exc
        return body

    async def put_file(self, key: str, stream: BinaryIO) -> None:
        await asyncio.to_thread(self._call, self._client.upload_fileobj, stream, self.bucket, self._key(key))

    async def read_range(self, key: str, start: int, size: int) -> bytes:
        if size <= 0:
            return b""
        return await asyncio.to_thread(self._get, self._key(key), f"bytes={start}-{start + size - 1}")

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(
            self._call, self._client.delete_object, Bucket=self.bucket, Key=self._key(key)
        )

    @staticmethod
    def _call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A call whose botocore errors are StoreUnavailable (an outage, for callers to retry)."""
        try:
            return method(*args, **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise StoreUnavailable(f"the object store failed: {type(exc).__name__}") from exc


def object_store(location: str, s3_client_factory: Callable[[], Any] | None = None) -> ObjectStore:
    """The store at `location`: `s3://bucket/prefix`, or a local folder."""
    s3 = parse_s3(location)
    if s3 is None:
        return LocalStore(Path(location))
    return S3Store(s3.bucket, s3.prefix, s3_client_factory or default_s3_client)
