"""Where uploaded and result files live: a local folder, or S3 (`s3://bucket/prefix`, boto3 with the usual
AWS settings; AWS_ENDPOINT_URL_S3 names another S3-compatible store). Both run their blocking calls in a
thread, so the event loop never waits on the disk or the network."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from queue_schemas.model_store import default_s3_client, parse_s3


class ObjectStore(Protocol):
    async def put(self, key: str, data: bytes) -> None: ...

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

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._path(key).read_bytes)

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
        await asyncio.to_thread(self._client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._get, self._key(key))

    def _get(self, key: str) -> bytes:
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=key)
        except self._client.exceptions.NoSuchKey:
            raise FileNotFoundError(key) from None
        body: bytes = reply["Body"].read()
        return body

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._client.delete_object, Bucket=self.bucket, Key=self._key(key))


def object_store(location: str, s3_client_factory: Callable[[], Any] | None = None) -> ObjectStore:
    """The store at `location`: `s3://bucket/prefix`, or a local folder."""
    s3 = parse_s3(location)
    if s3 is None:
        return LocalStore(Path(location))
    return S3Store(s3.bucket, s3.prefix, s3_client_factory or default_s3_client)
