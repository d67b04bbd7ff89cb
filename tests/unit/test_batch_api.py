"""The pure parts of /v1/files and /v1/batches: input checks, ids, the keeper's decisions, result files."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from ingress.batches.api import (
    CANCEL_GRACE_S,
    MAX_LINE_BYTES,
    MAX_REQUESTS,
    BatchCreate,
    FileRecord,
    Status,
    Step,
    batch_object,
    create_problem,
    final_status,
    line_request_id,
    local_error_line,
    new_batch_fields,
    new_batch_id,
    new_file_id,
    next_step,
    page,
    parse_line_request_id,
    read_input,
    request_lines,
    result_file_id,
    scan_file,
    split_results,
)
from ingress.batches.files import READ_WINDOW, lines_from, read_window
from ingress.batches.object_store import LocalStore
from queue_schemas.keys import TeamKey


def line(custom_id: str, **over: object) -> str:
    obj: dict[str, object] = {
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }  # fmt: skip
    obj.update(over)
    return json.dumps(obj)


def test_a_good_file_reads_as_its_lines_skipping_blank_ones() -> None:
    lines = read_input(f"{line('a')}\n\n{line('b', url='/v1/completions')}\n".encode())
    assert not isinstance(lines, str)
    assert [(x.number, x.custom_id, x.url) for x in lines] == [
        (0, "a", "/v1/chat/completions"),
        (2, "b", "/v1/completions"),
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "Line 1: not valid JSON"),
        ("[1]", "Line 1: not a JSON object"),
        (line("a") + "\n" + line("a"), "Line 2: custom_id 'a' appears more than once"),
        (line(""), "custom_id must be a string"),
        (line("a", method="GET"), "method must be POST"),
        (line("a", url="/v1/embeddings"), "url must be one of"),
        (line("a", body=[]), "body must be a JSON object"),
        (line("a", body={"messages": []}), "body.model must be a string"),
        (line("a", body={"model": "m", "stream": True}), "body.stream must be false"),
        (line("a", extra=1), "unknown field 'extra'"),
        ("\n\n", "holds no requests"),
    ],
)
def test_a_bad_file_is_refused_with_the_first_problem(text: str, problem: str) -> None:
    found = read_input(text.encode())
    assert isinstance(found, str)
    assert problem in found


def test_too_many_requests_or_not_utf8() -> None:
    many = "\n".join(line(f"c{n}") for n in range(MAX_REQUESTS + 1)).encode()
    assert read_input(many) == f"The file has more than {MAX_REQUESTS} requests."
    assert read_input(b"\xff\xfe") == "The file is not UTF-8 text."


def test_ids_are_unguessable_and_line_ids_round_trip() -> None:
    assert len({new_file_id() for _ in range(100)}) == 100
    assert new_batch_id().startswith("batch_")
    assert len(new_batch_id()) == len("batch_") + 32
    rid = line_request_id("acme", "batch_00ff", 41)
    assert parse_line_request_id(rid) == ("acme", "batch_00ff", 41)
    for other in (None, "", "acme:x:1", "acme:batch_1:x", "a:b:batch_1:1", "plain-id"):
        assert parse_line_request_id(other) is None
    assert result_file_id("batch_00ff", "output") == "file-output-00ff"


def create(**over: object) -> BatchCreate:
    base: dict[str, object] = {
        "input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h",
    }  # fmt: skip
    return BatchCreate.model_validate({**base, **over})


def test_create_checks_endpoint_window_and_metadata() -> None:
    assert create_problem(create()) is None
    assert create_problem(create(endpoint="/v1/embeddings"))[1] == "endpoint"  # type: ignore[index]
    assert create_problem(create(completion_window="1h"))[1] == "completion_window"  # type: ignore[index]
    many = {f"k{n}": "v" for n in range(17)}
    assert create_problem(create(metadata=many))[1] == "metadata"  # type: ignore[index]
    assert create_problem(create(metadata={"k": "v" * 513}))[1] == "metadata"  # type: ignore[index]


def fields(status: Status, **over: str) -> dict[str, str]:
    key = TeamKey(team="acme", key_id="sk-1", created_at=0.0)
    base = new_batch_fields("batch_1", key, create(metadata={"a": "b"}), 10, 1000.0)
    base.update(status=status.value, **over)
    return base


@pytest.mark.parametrize(
    ("status", "over", "answered", "now", "step"),
    [
        (Status.VALIDATING, {}, 0, 1001.0, Step.VALIDATE),
        (Status.IN_PROGRESS, {"cursor": "3"}, 0, 1001.0, Step.SUBMIT),
        (Status.IN_PROGRESS, {"cursor": "10"}, 4, 1001.0, Step.WAIT),
        (Status.IN_PROGRESS, {"cursor": "10"}, 10, 1001.0, Step.FINALIZE),
        (Status.IN_PROGRESS, {"cursor": "10"}, 4, 1000.0 + 86400, Step.EXPIRE),
        (Status.CANCELLING, {"cancelling_at": "1100"}, 4, 1101.0, Step.CANCEL),
        (Status.CANCELLING, {"cancelling_at": "1100", "cancel_sent": "1"}, 4, 1101.0, Step.WAIT),
        (
            Status.CANCELLING, {"cancelling_at": "1100", "cancel_sent": "1"}, 4, 1100 + CANCEL_GRACE_S,
            Step.CLOSE_CANCELLED,
        ),
        (Status.CANCELLING, {"cancel_sent": "1"}, 10, 1101.0, Step.FINALIZE),
        (Status.FINALIZING, {}, 10, 1101.0, Step.FINALIZE),
        (Status.COMPLETED, {}, 10, 1101.0, Step.DONE),
        (Status.FAILED, {}, 0, 1101.0, Step.DONE),
    ],
)  # fmt: skip
def test_the_keepers_next_step(
    status: Status, over: dict[str, str], answered: int, now: float, step: Step
) -> None:
    assert next_step(fields(status, **over), answered, now) is step


def test_where_a_finalized_batch_ends() -> None:
    assert final_status(Status.CANCELLING, expired=False) is Status.CANCELLED
    assert final_status(Status.IN_PROGRESS, expired=True) is Status.EXPIRED
    assert final_status(Status.IN_PROGRESS, expired=False) is Status.COMPLETED


def test_results_split_in_input_order() -> None:
    ok = {"id": "x", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    refused = {"id": "y", "custom_id": "b", "response": {"status_code": 400, "body": {}}, "error": None}
    cancelled = local_error_line("acme", "batch_1", 2, "c", "cancelled", "gone")
    output, errors = split_results({2: json.dumps(cancelled), 0: json.dumps(ok), 1: json.dumps(refused)})
    assert [json.loads(t)["custom_id"] for t in output.decode().splitlines()] == ["a"]
    assert [json.loads(t)["custom_id"] for t in errors.decode().splitlines()] == ["b", "c"]
    assert cancelled["error"] == {"code": "cancelled", "message": "gone"}
    assert cancelled["response"] is None


def test_the_batch_object_has_openais_fields() -> None:
    obj = batch_object(fields(Status.IN_PROGRESS, in_progress_at="1001", completed="3", failed="1"))
    assert obj["object"] == "batch"
    assert obj["request_counts"] == {"total": 10, "completed": 3, "failed": 1}
    assert obj["metadata"] == {"a": "b"}
    assert (obj["created_at"], obj["in_progress_at"], obj["expires_at"]) == (1000, 1001, 1000 + 86400)
    assert obj["output_file_id"] is None
    assert obj["errors"] is None


def test_pages_follow_the_cursor() -> None:
    ids = [f"b{n}" for n in range(5)]
    assert page(ids, None, 2) == (["b0", "b1"], True)
    assert page(ids, "b1", 2) == (["b2", "b3"], True)
    assert page(ids, "b3", 2) == (["b4"], False)
    assert page(ids, "gone", 10) == (ids, False)


def test_endpoints_name_the_files_own_line_numbers() -> None:
    text = "\n".join(["", line("a"), line("b", url="/v1/completions")]) + "\n"
    summary = scan_file(io.BytesIO(text.encode()))
    assert not isinstance(summary, str)
    assert summary.endpoints == {"/v1/chat/completions": 2, "/v1/completions": 3}


def test_a_window_of_blank_lines_still_moves_on() -> None:
    blank = b" " * 1000 + b"\n"
    data = blank * 3 + line("a").encode() + b"\n"
    found, used = request_lines(blank * 3, at_end=False, most=10)
    assert found == []
    assert used == len(blank) * 3
    found, used = request_lines(data, at_end=True, most=10)
    assert [item[0].custom_id for item in found] == ["a"]
    assert used == len(data)
    found, used = request_lines(data + data[:5], at_end=False, most=10)
    assert used == len(data)  # an unfinished last line is left for the next window


def test_every_request_is_read_past_windows_of_blank_lines(tmp_path: Path) -> None:
    blank = b" " * (MAX_LINE_BYTES - 1) + b"\n"
    data = line("a").encode() + b"\n" + blank * 5 + line("b").encode() + b"\n" + blank + line("c").encode()
    assert len(blank) * 5 > READ_WINDOW
    store = LocalStore(tmp_path)
    record = FileRecord(
        id="file-x", team="t", purpose="batch", filename="x.jsonl", bytes=len(data), created_at=0,
        key="t/file-x", lines=3,
    )  # fmt: skip

    async def read() -> tuple[list[str], list[int]]:
        await store.put(record.key, data)
        seen = [item.custom_id async for item in lines_from(store, record, 0)]
        offsets = [0]
        while offsets[-1] < len(data):
            _, after = await read_window(store, record, offsets[-1], 10)
            offsets.append(after)
        return seen, offsets

    seen, offsets = asyncio.run(read())
    assert seen == ["a", "b", "c"]
    assert offsets[-1] == len(data)
    assert len(offsets) > 3
