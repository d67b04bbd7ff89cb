"""Model sources: an object-store prefix, a local folder, or a hub id, resolved to a local folder.

`s3://bucket/prefix` is downloaded once into the cache folder and re-used while complete. A download
goes to a private temporary folder, every file is checked against the listed size and ETag, and the
folder is renamed into place only when all of it verified; a lock file makes concurrent workers on one
machine wait for one download instead of racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

COMPLETE_MARK = ".sluice-complete.json"
_CHUNK = 1 << 20
_MIB = 1 << 20
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


MODEL_MARKS = ("config.json", "tokenizer.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ModelSourceError(Exception):
    """The model cannot be found, downloaded or verified; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    key: str
    size: int
    etag: str


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str

    @property
    def key_prefix(self) -> str:
        """What the keys of the source's objects start with ("" for a whole bucket)."""
        return f"{self.prefix}/" if self.prefix else ""

    def file_name(self, key: str) -> str:
        """An object's path inside the model folder. A key that would land outside it (`..`, an empty
        or `.` part from `//`, an absolute path) makes the whole source refused."""
        name = key[len(self.key_prefix) :]
        parts = name.split("/")
        if (
            name.startswith("/")
            or "\\" in name
            or any(part in ("", ".", "..") for part in parts[:-1])
            or (parts[-1] in (".", ".."))
        ):
            raise ModelSourceError(
                f"s3://{self.bucket}/{key}: the object key does not name a file inside the model folder"
            )
        return name


def parse_s3(source: str) -> S3Location | None:
    """`s3://bucket/prefix` -> its parts; None for any other kind of source."""
    if not source.startswith("s3://"):
        return None
    bucket, _, prefix = source.removeprefix("s3://").partition("/")
    if not bucket:
        raise ModelSourceError(f"{source}: no bucket named")
    return S3Location(bucket, prefix.strip("/"))


def cache_folder(cache_root: Path, source: str) -> Path:
    """Where a source's files live locally: readable name plus a digest, so sources never collide."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    readable = "".join(c if c.isalnum() or c in "-_." else "-" for c in source.removeprefix("s3://"))[-60:]
    return cache_root / f"{readable}-{digest}"


def expected_etag(path: Path, etag: str, size: int) -> str:
    """The ETag an object store gives this file's bytes: MD5, or for a multipart upload the MD5 of the
    part MD5s with the part count (part size inferred from the count, in whole MiB as clients upload)."""
    etag = etag.strip('"')
    if "-" not in etag:
        return _md5(path, None)[0]
    parts = int(etag.rsplit("-", 1)[1])
    part_size = max(_MIB, -(-size // parts // _MIB) * _MIB) if parts else size
    return _md5(path, part_size)[1] + f"-{parts}"


def _md5(path: Path, part_size: int | None) -> tuple[str, str]:
    whole = hashlib.md5(usedforsecurity=False)
    part_digests: list[bytes] = []
    part = hashlib.md5(usedforsecurity=False)
    in_part = 0
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            whole.update(block)
            if part_size is None:
                continue
            while block:
                take = block[: part_size - in_part]
                part.update(take)
                in_part += len(take)
                block = block[len(take) :]
                if in_part == part_size:
                    part_digests.append(part.digest())
                    part, in_part = hashlib.md5(usedforsecurity=False), 0
    if in_part:
        part_digests.append(part.digest())
    return whole.hexdigest(), hashlib.md5(b"".join(part_digests), usedforsecurity=False).hexdigest()


def verify(path: Path, entry: ObjectEntry) -> str | None:
    """Why a downloaded file does not match its listing, or None when it does."""
    if not path.is_file():
        return f"{entry.key}: missing"
    size = path.stat().st_size
    if size != entry.size:
        return f"{entry.key}: {size} bytes, the store lists {entry.size}"
    got = expected_etag(path, entry.etag, entry.size)
    if got != entry.etag.strip('"'):
        return f"{entry.key}: content hash {got} does not match ETag {entry.etag.strip(chr(34))}"
    return None


def _complete_listing(folder: Path) -> list[ObjectEntry] | None:
    try:
        raw = json.loads((folder / COMPLETE_MARK).read_text())
        return [ObjectEntry(**e) for e in raw["objects"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class ModelStore:
    """Resolves model sources to local folders, downloading `s3://` prefixes into `cache_root`."""

    def __init__(self, cache_root: Path, s3_client_factory: Callable[[], Any] | None = None) -> None:
        self.cache_root = cache_root
        self._s3_factory = s3_client_factory or default_s3_client

    def resolve(
        self, source: str, only: tuple[str, ...] | None = None, marks: tuple[str, ...] = MODEL_MARKS
    ) -> Path:
        """A local folder holding the source's files (`only`: just these file names, e.g. a tokenizer).
        A local folder must hold one of `marks` (a model's or tokenizer's files; an adapter's)."""
        location = parse_s3(source)
        if location is not None:
            return self._fetch_s3(source, location, only)
        folder = Path(source).expanduser()
        if folder.is_dir():
            if not any((folder / mark).exists() for mark in marks):
                raise ModelSourceError(f"{source}: the folder holds none of {', '.join(marks)}")
            return folder
        if source.startswith(("/", ".", "~")) or source.count("/") != 1:
            raise ModelSourceError(f"{source}: no such model folder")
        return self._from_hub(source)

    def _from_hub(self, repo_id: str) -> Path:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id))
        except Exception as exc:  # the hub client raises many kinds; all mean "not available here"
            raise ModelSourceError(
                f"{repo_id}: not a local folder, and the model hub failed: {exc}"
            ) from None

    def _fetch_s3(self, source: str, location: S3Location, only: tuple[str, ...] | None) -> Path:
        key = source if only is None else f"{source}#{','.join(only)}"
        dest = cache_folder(self.cache_root, key)
        with _locked(dest.with_name(dest.name + ".lock")):
            listing = self._list(location, only)
            if listing is None:  # the store is unreachable: a complete earlier download still serves
                if _complete_listing(dest) is not None:
                    return dest
                raise ModelSourceError(f"{source}: the object store is unreachable and nothing is cached")
            if _complete_listing(dest) == listing and all(verify_size(dest, e, location) for e in listing):
                return dest
            self._download(location, listing, dest)
        return dest

    def _list(self, location: S3Location, only: tuple[str, ...] | None) -> list[ObjectEntry] | None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self._s3_factory()
        entries: list[ObjectEntry] = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=location.bucket, Prefix=location.key_prefix
            ):
                for obj in page.get("Contents", []):
                    name = location.file_name(obj["Key"])
                    if not name or name.endswith("/") or (only is not None and name not in only):
                        continue
                    entries.append(ObjectEntry(obj["Key"], int(obj["Size"]), str(obj["ETag"])))
        except ClientError as exc:
            raise ModelSourceError(f"s3://{location.bucket}/{location.prefix}: {exc}") from None
        except BotoCoreError:
            return None
        if not entries:
            raise ModelSourceError(f"s3://{location.bucket}/{location.prefix}: no objects under this prefix")
        return sorted(entries, key=lambda e: e.key)

    def _download(self, location: S3Location, listing: list[ObjectEntry], dest: Path) -> None:
        client = self._s3_factory()
        staging = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
        try:
            for entry in listing:
                target = staging / location.file_name(entry.key)
                target.parent.mkdir(parents=True, exist_ok=True)
                with target.open("wb") as fh:
                    _copy_body(client.get_object(Bucket=location.bucket, Key=entry.key)["Body"], fh)
                problem = verify(target, entry)
                if problem is not None:
                    raise ModelSourceError(f"corrupt download from s3://{location.bucket}/{problem}")
            (staging / COMPLETE_MARK).write_text(json.dumps({"objects": [asdict(e) for e in listing]}))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def verify_size(folder: Path, entry: ObjectEntry, location: S3Location) -> bool:
    path = folder / location.file_name(entry.key)
    return path.is_file() and path.stat().st_size == entry.size


def _copy_body(body: Any, out: BinaryIO) -> None:
    try:
        while block := body.read(_CHUNK):
            out.write(block)
    finally:
        body.close()


def default_s3_client() -> Any:
    """A boto3 S3 client configured from the usual AWS settings (AWS_ENDPOINT_URL_S3 for other stores)."""
    import boto3

    return boto3.client("s3")
