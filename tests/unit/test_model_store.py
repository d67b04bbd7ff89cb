"""Model sources: parsing, cache folders, and verification of downloaded files against the listing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from plumbing.model_store import (
    ADAPTER_FILES,
    ModelSourceError,
    ModelStore,
    ObjectEntry,
    S3Location,
    cache_folder,
    expected_etag,
    parse_s3,
    verify,
)


def test_parse_s3() -> None:
    assert parse_s3("s3://bucket/models/small/") == S3Location("bucket", "models/small")
    assert parse_s3("s3://bucket") == S3Location("bucket", "")
    assert parse_s3("/models/small") is None
    with pytest.raises(ModelSourceError, match="no bucket"):
        parse_s3("s3:///x")


def test_cache_folders_never_collide() -> None:
    root = Path("/cache")
    a, b = cache_folder(root, "s3://b/m-1"), cache_folder(root, "s3://b/m_1")
    assert a != b
    assert a.parent == root


def test_single_part_etag_is_the_md5(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"weights" * 1000)
    md5 = hashlib.md5(f.read_bytes(), usedforsecurity=False).hexdigest()
    entry = ObjectEntry("m/w.bin", f.stat().st_size, f'"{md5}"')
    assert verify(f, entry) is None
    f.write_bytes(b"weightz" * 1000)  # same size, other bytes
    assert "does not match ETag" in (verify(f, entry) or "")
    f.write_bytes(b"short")
    assert "5 bytes" in (verify(f, entry) or "")


def test_multipart_etag(tmp_path: Path) -> None:
    part = 1 << 20
    data = bytes(range(256)) * (part * 2 // 256) + b"tail"
    f = tmp_path / "w.bin"
    f.write_bytes(data)
    digests = [
        hashlib.md5(data[i : i + part], usedforsecurity=False).digest() for i in range(0, len(data), part)
    ]
    etag = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + "-3"
    assert expected_etag(f, etag, len(data)) == etag
    assert verify(f, ObjectEntry("w.bin", len(data), etag)) is None


def test_local_sources(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "cache")
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ModelSourceError, match=r"none of config\.json, tokenizer\.json"):
        store.resolve(str(model))
    (model / "config.json").write_text("{}")
    assert store.resolve(str(model)) == model
    with pytest.raises(ModelSourceError, match="no such model folder"):
        store.resolve(str(tmp_path / "missing"))


def test_an_adapter_folder_is_found_by_its_own_files(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "cache")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"none of config\.json"):
        store.resolve(str(adapter))  # not a model
    assert store.resolve(str(adapter), marks=ADAPTER_FILES) == adapter
