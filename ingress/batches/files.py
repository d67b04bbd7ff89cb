"""Reading a batch's input file and writing its result files, a window at a time: the keeper never holds a
whole file. Input files were checked line by line at upload (ingress.batches.api.FileScan), so a
window of READ_WINDOW bytes always holds at least one whole line (each is at most MAX_LINE_BYTES)."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import IO

from ingress.batches.api import MAX_LINE_BYTES, FileRecord, InputLine, request_lines, succeeded
from ingress.batches.object_store import ObjectStore

READ_WINDOW = 2 * MAX_LINE_BYTES + 2
LINES_PAGE = 1000  # answered lines read from Redis at a time when the result files are written
SPOOL_BYTES = 4 * 1024 * 1024  # a result file stays in memory up to this, then goes to disk


async def read_window(
    store: ObjectStore, record: FileRecord, offset: int, most: int
) -> tuple[list[tuple[InputLine, int]], int]:
    """Up to `most` request lines from byte `offset` of the file, each with the file offset just past it,
    and the file offset where the next window starts (past any blank lines read). A window of blank lines
    alone finds no request but still moves on."""
    data = await store.read_range(record.key, offset, READ_WINDOW)
    # Parsing a window of many long lines can take a quarter of a second of CPU: on a thread, not the loop.
    found, used = await asyncio.to_thread(request_lines, data, offset + len(data) >= record.bytes, most)
    return [(line, offset + end) for line, end in found], offset + used


async def lines_from(store: ObjectStore, record: FileRecord, offset: int) -> AsyncIterator[InputLine]:
    """Every request line from byte `offset` to the file's end."""
    while offset < record.bytes:
        window, after = await read_window(store, record, offset, LINES_PAGE)
        if after <= offset:
            raise ValueError(f"no whole line at byte {offset} of a checked file")
        for line, _ in window:
            yield line
        offset = after


ReadLines = Callable[[list[int]], Awaitable[list[str | None]]]


async def write_results(
    store: ObjectStore, keys: tuple[str, str], total: int, read: ReadLines
) -> tuple[int, int]:
    """Write every answered line, in input order, to the output file (successes) and the error file
    (the rest) under `keys`; `read` gives the answers of a page of line numbers. Returns both files'
    sizes; a file with no line is not written."""
    with (
        tempfile.SpooledTemporaryFile(SPOOL_BYTES) as output,
        tempfile.SpooledTemporaryFile(SPOOL_BYTES) as errors,
    ):
        spools: tuple[IO[bytes], IO[bytes]] = (output, errors)
        for start in range(0, total, LINES_PAGE):
            numbers = list(range(start, min(total, start + LINES_PAGE)))
            out, err = _split_page(await read(numbers))
            await asyncio.to_thread(_append, spools, out, err)
        sizes = (output.tell(), errors.tell())
        for spool, key, size in zip(spools, keys, sizes, strict=True):
            if size:
                spool.seek(0)
                await store.put_file(key, spool)  # type: ignore[arg-type]
        return sizes


def _split_page(answers: list[str | None]) -> tuple[bytes, bytes]:
    out: list[str] = []
    err: list[str] = []
    for text in answers:
        if text is not None:
            (out if succeeded(json.loads(text)) else err).append(text + "\n")
    return "".join(out).encode(), "".join(err).encode()


def _append(spools: tuple[IO[bytes], IO[bytes]], out: bytes, err: bytes) -> None:
    spools[0].write(out)
    spools[1].write(err)
