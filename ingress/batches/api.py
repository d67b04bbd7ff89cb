"""OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`) over sluice's batch topics.

A batch's input file is checked line by line when it is uploaded. Each line then becomes an ordinary
batch submission (queue_schemas.batch) on its pool's batch topic, signed by the ingress that authenticated
the team, and answered on an internal topic; the ingress's batch keeper collects the answers, one per
line, into the output and error files. docs/batch.md describes the API and its limits.

Redis layout (all in the team's hash slot): a hash per batch (`Names.batch_record`) with the fields below,
a hash of output lines by input line number (`Names.batch_lines`), and per-team indexes of files and
batches. Only the keeper that holds a batch's lease moves it along; cancelling is a guarded transition any
ingress may make.

Pure: file checks, ids, state decisions and the OpenAI objects. Reading and writing live in ingress.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, BinaryIO

from pydantic import BaseModel, ConfigDict, Field

from queue_schemas.batch import ENDPOINTS, failure_answer, http_answer
from queue_schemas.boundary import InputLimits, InputRefused, load_untrusted
from queue_schemas.keys import TeamKey

# OpenAI's limits on a batch input file.
MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_REQUESTS = 50_000
# A line becomes one Kafka record (1 MiB by default on the broker and producer): half of it leaves room
# for the submission's own fields and the signature.
MAX_LINE_BYTES = 512 * 1024
LINE_LIMITS = InputLimits(max_string_chars=MAX_LINE_BYTES)
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# How long a cancelled batch waits for the answers of lines already with workers (each is answered
# `cancelled` or with its result) before the keeper writes the rest as cancelled itself.
CANCEL_GRACE_S = 60.0


class Status(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)
CANCELLABLE = (Status.VALIDATING, Status.IN_PROGRESS)


def new_file_id() -> str:
    return "file-" + secrets.token_hex(16)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: fixed by the batch, so finalizing twice writes one file."""
    return f"file-{kind}-{batch_id.removeprefix('batch_')}"


def line_request_id(team: str, batch_id: str, line: int) -> str:
    """The submission id of an input line (unique per team; ':' never appears in team names)."""
    return f"{team}:{batch_id}:{line}"


def parse_line_request_id(request_id: str | None) -> tuple[str, str, int] | None:
    """(team, batch id, line) of a line's submission id, or None for anything else."""
    parts = (request_id or "").split(":")
    if len(parts) != 3 or not parts[1].startswith("batch_") or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


class FileRecord(BaseModel):
    """What Redis holds for a file; its bytes live in the object store under `key`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    team: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    key: str
    lines: int = 0
    endpoints: dict[str, int] = Field(default_factory=dict)  # url -> first line (1-based) that uses it
    expires_at: int | None = None

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
            "filename": self.filename, "purpose": self.purpose, "status": "processed",
            "status_details": None, "expires_at": self.expires_at,
        }  # fmt: skip

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


# OpenAI's bounds on `expires_after.seconds` (one hour to thirty days).
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600


def expiry_problem(anchor: object, seconds: object) -> str | None:
    """What is wrong with an `expires_after` (anchor and seconds as sent), or None."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        return "expires_after.anchor must be 'created_at'."
    text = str(seconds) if isinstance(seconds, (str, int)) and not isinstance(seconds, bool) else ""
    if not text.isdigit() or not MIN_EXPIRY_S <= int(text) <= MAX_EXPIRY_S:
        return f"expires_after.seconds must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}."
    return None


def expires_at(created_at: int, seconds: object, default_s: int) -> int:
    """When a file expires: `seconds` after its creation if given (checked by expiry_problem)."""
    return created_at + (int(str(seconds)) if seconds is not None else default_s)


def object_key(team: str, file_id: str) -> str:
    return f"files/{team}/{file_id}"


@dataclass(frozen=True, slots=True)
class InputLine:
    number: int  # in the file, counting blank lines (for messages); requests are numbered by position
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FileSummary:
    """What checking a whole input file found: its requests and, per url, the first line using it."""

    requests: int
    endpoints: dict[str, int]


class FileScan:
    """Checks an input file line by line as it is read, holding only a digest of each custom_id: the
    checks `sluice batch` makes (JSON object through the input boundary, a unique non-empty custom_id,
    POST to a served endpoint, a body object naming a model), a line within MAX_LINE_BYTES, and
    OpenAI's limits. Blank lines are skipped."""

    def __init__(self) -> None:
        self.problem: str | None = None
        self.number = 0  # lines read, blank ones included
        self.size = 0
        self.requests = 0
        self.endpoints: dict[str, int] = {}
        self._seen: set[bytes] = set()

    def add(self, raw: bytes) -> None:
        """One line as read from the file (with its newline, if it had one)."""
        if self.problem is not None:
            return
        self.size += len(raw)
        self.number += 1
        if self.size > MAX_FILE_BYTES:
            self.problem = f"The file exceeds the {MAX_FILE_BYTES}-byte limit for batch input."
            return
        if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
            self.problem = f"Line {self.number}: longer than the {MAX_LINE_BYTES}-byte limit of a line"
            return
        try:
            raw.decode()
        except UnicodeDecodeError:
            self.problem = "The file is not UTF-8 text."
            return
        if not raw.strip():
            return
        line = parse_line(raw, self.number - 1, self._seen)
        if isinstance(line, str):
            self.problem = f"Line {self.number}: {line}"
            return
        self.endpoints.setdefault(line.url, self.number)  # 1-based, blank lines counted
        self.requests += 1
        if self.requests > MAX_REQUESTS:
            self.problem = f"The file has more than {MAX_REQUESTS} requests."

    def result(self) -> FileSummary | str:
        if self.problem is not None:
            return self.problem
        if not self.requests:
            return "The file holds no requests."
        return FileSummary(self.requests, dict(self.endpoints))


def read_lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of a binary file, each cut at MAX_LINE_BYTES + 2 bytes so a line without an end never
    fills memory (FileScan refuses the cut line)."""
    while True:
        raw = stream.readline(MAX_LINE_BYTES + 2)
        if not raw:
            return
        yield raw
        if not raw.endswith(b"\n"):  # a cut line: skip to its end without keeping it
            while raw and not raw.endswith(b"\n"):
                raw = stream.readline(MAX_LINE_BYTES + 2)


def scan_file(stream: BinaryIO) -> FileSummary | str:
    """Check a whole input file from `stream` (blocking: run it in a thread)."""
    scan = FileScan()
    for raw in read_lines(stream):
        scan.add(raw)
        if scan.problem is not None:
            break
    return scan.result()


def read_input(data: bytes) -> list[InputLine] | str:
    """Every request line of a small input file held in memory, or why it is refused (as FileScan)."""
    scan = FileScan()
    lines: list[InputLine] = []
    for raw in read_lines(io.BytesIO(data)):
        scan.add(raw)
        if scan.problem is not None:
            return scan.problem
        if raw.strip():
            line = parse_line(raw, scan.number - 1, set())
            assert not isinstance(line, str)
            lines.append(line)
    result = scan.result()
    return result if isinstance(result, str) else lines


def parse_line(raw: bytes, number: int, seen: set[bytes]) -> InputLine | str:
    """One request line, or why it is refused. `seen` holds digests of the custom_ids before it."""
    try:
        obj = load_untrusted(raw, LINE_LIMITS)
    except InputRefused as exc:
        if exc.message.startswith("The body is not valid JSON"):
            return "not valid JSON" + exc.message.removeprefix("The body is not valid JSON")
        return exc.message
    if not isinstance(obj, dict):
        return "not a JSON object"
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        return f"unknown field {sorted(unknown)[0]!r}"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        return "custom_id must be a string of 1 to 512 characters"
    digest = hashlib.sha256(custom_id.encode()).digest()[:16]
    if digest in seen:
        return f"custom_id {custom_id!r} appears more than once"
    seen.add(digest)
    if obj.get("method") != "POST":
        return "method must be POST"
    url = obj.get("url")
    if url not in ENDPOINTS:
        return f"url must be one of {', '.join(ENDPOINTS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if not isinstance(body.get("model"), str):
        return "body.model must be a string"
    if body.get("stream"):
        return "body.stream must be false or absent in a batch"
    return InputLine(number, custom_id, url, body)


def request_lines(data: bytes, at_end: bool, most: int) -> tuple[list[tuple[InputLine, int]], int]:
    """Up to `most` request lines at the start of `data` (a window of a file already checked at upload,
    read from a line's start), each with the offset in `data` just past it, and the offset just past the
    last whole line read, blank ones included (where the next window starts). A last line without its
    newline counts only when the window reaches the file's end."""
    lines: list[tuple[InputLine, int]] = []
    used = 0
    number = 0
    while used < len(data) and len(lines) < most:
        end = data.find(b"\n", used)
        if end < 0 and not at_end:
            break
        stop = len(data) if end < 0 else end + 1
        raw = data[used:stop]
        used = stop
        if raw.strip():
            line = parse_line(raw, number, set())
            if isinstance(line, str):
                raise ValueError(f"a line of a checked file no longer parses: {line}")
            lines.append((line, used))
        number += 1
    return lines, used


class BatchCreate(BaseModel):
    """The body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def create_problem(body: BatchCreate) -> tuple[str, str] | None:
    """(message, param) of what is wrong with a create request, or None."""
    if body.endpoint not in ENDPOINTS:
        return f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint"
    if body.completion_window not in COMPLETION_WINDOWS:
        return f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}.", "completion_window"
    expiry = output_expiry_problem(body)
    if expiry is not None:
        return expiry, "output_expires_after"
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        return f"metadata holds at most {MAX_METADATA_PAIRS} pairs.", "metadata"
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            return (
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}.",
                "metadata",
            )
    return None


def output_expiry_problem(body: BatchCreate) -> str | None:
    after = body.output_expires_after
    if after is None:
        return None
    return expiry_problem(after.get("anchor"), after.get("seconds"))


def new_batch_fields(
    batch_id: str, key: TeamKey, body: BatchCreate, input_lines: int, now: float, key_hash: str = ""
) -> dict[str, str]:
    """The hash of a batch just created. The key that created it is kept whole: its lines may use only
    the pools and adapters it may."""
    window = COMPLETION_WINDOWS[body.completion_window]
    return {
        "id": batch_id,
        "team": key.team,
        "key_id": key.key_id,
        "key": key.model_dump_json(),
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "metadata": json.dumps(body.metadata) if body.metadata is not None else "",
        "status": Status.VALIDATING.value,
        "created_at": str(int(now)),
        "expires_at": str(int(now + window)),
        "total": str(input_lines),
        "cursor": "0",
        "offset": "0",  # byte offset in the input file of the line at `cursor`
        "completed": "0",
        "failed": "0",
        "key_hash": key_hash,  # the key is looked up each round: a revoked key cancels the batch
        "output_expires_s": str((body.output_expires_after or {}).get("seconds") or ""),
    }


def decode_fields(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    return {as_text(k): as_text(v) for k, v in raw.items()}


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def batch_object(fields: Mapping[str, str]) -> dict[str, Any]:
    """The OpenAI batch object of a batch's hash."""

    def stamp(name: str) -> int | None:
        value = fields.get(name)
        return int(value) if value else None

    errors = fields.get("errors")
    metadata = fields.get("metadata")
    return {
        "id": fields["id"],
        "object": "batch",
        "endpoint": fields["endpoint"],
        "errors": json.loads(errors) if errors else None,
        "input_file_id": fields["input_file_id"],
        "completion_window": fields["completion_window"],
        "status": fields["status"],
        "output_file_id": fields.get("output_file_id") or None,
        "error_file_id": fields.get("error_file_id") or None,
        "created_at": int(fields["created_at"]),
        **{
            f"{name}_at": stamp(f"{name}_at")
            for name in ("in_progress", "expires", "finalizing", "completed", "failed", "expired")
        },
        "cancelling_at": stamp("cancelling_at"),
        "cancelled_at": stamp("cancelled_at"),
        "request_counts": {
            "total": int(fields.get("total", "0")),
            "completed": int(fields.get("completed", "0")),
            "failed": int(fields.get("failed", "0")),
        },
        "metadata": json.loads(metadata) if metadata else None,
    }


def validation_errors(message: str, param: str | None = None, line: int | None = None) -> str:
    """The `errors` field of a batch that failed validation."""
    error = {"code": "invalid_request", "message": message, "param": param, "line": line}
    return json.dumps({"object": "list", "data": [error]})


class Step(StrEnum):
    """What the keeper does next for a batch."""

    VALIDATE = "validate"
    SUBMIT = "submit"  # send the next lines to their pools
    WAIT = "wait"  # for answers
    CANCEL = "cancel"  # answer unsent lines as cancelled, tell workers to drop the sent ones
    CLOSE_CANCELLED = "close_cancelled"  # past the grace: answer what is left as cancelled
    EXPIRE = "expire"  # past the window: answer what is left as expired
    FINALIZE = "finalize"
    DONE = "done"


def next_step(fields: Mapping[str, str], answered: int, now: float) -> Step:
    """The keeper's decision for one batch, from its hash and how many lines have an answer."""
    status = fields.get("status")
    total, cursor = int(fields.get("total", "0")), int(fields.get("cursor", "0"))
    if status in FINAL or status is None:
        return Step.DONE
    if status == Status.VALIDATING:
        return Step.VALIDATE
    if status == Status.FINALIZING or answered >= total:
        return Step.FINALIZE
    if status == Status.CANCELLING:
        if not fields.get("cancel_sent"):
            return Step.CANCEL
        if now >= float(fields.get("cancelling_at", now)) + CANCEL_GRACE_S:
            return Step.CLOSE_CANCELLED
        return Step.WAIT
    if now >= float(fields["expires_at"]):
        return Step.EXPIRE
    return Step.SUBMIT if cursor < total else Step.WAIT


def final_status(status: str, expired: bool) -> Status:
    """Where a batch that is finalized ends: cancelled if it was being cancelled, expired if its window
    ran out, else completed."""
    if status == Status.CANCELLING:
        return Status.CANCELLED
    return Status.EXPIRED if expired else Status.COMPLETED


def local_error_line(
    team: str, batch_id: str, line: int, custom_id: str, code: str, message: str
) -> dict[str, Any]:
    """The output line of an input line answered by the keeper itself (never ran)."""
    rid = line_request_id(team, batch_id, line)
    return failure_answer(rid, rid, custom_id, code, message).output_line()


def local_http_line(
    team: str, batch_id: str, line: int, custom_id: str, status: int, error: dict[str, Any]
) -> dict[str, Any]:
    """The output line of an input line refused before it was sent (its model is not served here)."""
    rid = line_request_id(team, batch_id, line)
    return http_answer(rid, rid, custom_id, status, error).output_line()


def succeeded(line: Mapping[str, Any]) -> bool:
    response = line.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200


def split_results(lines: Mapping[int, str]) -> tuple[bytes, bytes]:
    """(output file, error file): every answered line in input order, successes in the first."""
    output: list[str] = []
    errors: list[str] = []
    for _, text in sorted(lines.items()):
        (output if succeeded(json.loads(text)) else errors).append(text)
    return _jsonl(output), _jsonl(errors)


def _jsonl(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def page(ids: list[str], after: str | None, limit: int) -> tuple[list[str], bool]:
    """Cursor pagination of newest-first ids: the next `limit` after `after`, and whether more follow."""
    start = ids.index(after) + 1 if after in ids else 0
    chunk = ids[start : start + limit]
    return chunk, start + limit < len(ids)


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def unanswered(total: int, answered: Iterator[int] | set[int]) -> list[int]:
    done = set(answered)
    return [n for n in range(total) if n not in done]
