"""Chat streams that outlive their connection (ingress.resume): every event has an id; a client that
drops mid-answer reads the rest through the other ingress with Last-Event-ID, each event once, and its
team is charged once; a client that never comes back has its request cancelled after the pool's grace
period and is charged what was generated."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from infra.devstack import DevStack, Endpoints
from plumbing.replay import read_log
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, TokenChunk
from queue_schemas.names import Names
from tests.e2e.conftest import day_used, team_key, terminal_log
from tests.e2e.test_streaming_contract import MESSAGES, chat_prompt_ids
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

Stack = tuple[DevStack, Endpoints]
BODY = {"model": "sluice-slow", "stream": True, "messages": MESSAGES, "max_tokens": 200,
        "stream_options": {"include_usage": True}}  # fmt: skip


def events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each SSE event with data, as a client parses them."""
    event_id: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def text_of(seen: list[tuple[str | None, str]]) -> str:
    out = ""
    for _, data in seen:
        if data.startswith("{"):
            for choice in json.loads(data).get("choices", []):
                out += choice.get("delta", {}).get("content") or ""
    return out


def usage_of(seen: list[tuple[str | None, str]]) -> dict[str, Any]:
    (usage,) = [json.loads(d)["usage"] for _, d in seen if d.startswith("{") and json.loads(d).get("usage")]
    return dict(usage)


def cut_after(url: str, key: str, chars: int) -> tuple[list[tuple[str | None, str]], str]:
    """Stream a chat and drop the connection once `chars` characters have come: the events read, and the
    stream's path (with its token) from the response header."""
    seen: list[tuple[str | None, str]] = []
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        path = r.headers["x-sluice-stream"]
        for event in events(r.iter_lines()):
            seen.append(event)
            if len(text_of(seen)) >= chars:
                break
    return seen, path


def uninterrupted(url: str, key: str) -> list[tuple[str | None, str]]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, headers=headers, timeout=60) as r:
        return list(events(r.iter_lines()))


def request_id_of(seen: list[tuple[str | None, str]]) -> str:
    first = json.loads(seen[0][1])
    return str(first["id"]).removeprefix("chatcmpl-")


def test_a_stream_cut_mid_answer_resumes_through_the_other_ingress(dev_stack: Stack) -> None:
    stack, endpoints = dev_stack
    first, second = stack.ingress_urls[:2]
    key = team_key(endpoints, "resume-cut")
    before, path = cut_after(first, key, 10)
    assert [e[0] for e in before] == [str(n) for n in range(len(before))], "every event has its number"
    rid = request_id_of(before)
    assert path.startswith(f"/v1/chat/completions/chatcmpl-{rid}/stream?token=")
    stream_url = second + path.split("?")[0]
    headers = {"Authorization": f"Bearer {key}", "Last-Event-ID": str(before[-1][0])}
    with httpx.stream("GET", stream_url, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        after = list(events(r.iter_lines()))
    ids = [int(str(e[0])) for e in before + after]
    assert ids == list(range(len(ids))), "each event exactly once, in order"
    assert after[-1][1] == "[DONE]"
    whole = uninterrupted(first, key)
    assert text_of(before) + text_of(after) == text_of(whole), "the same text as an uninterrupted run"
    usage, whole_usage = usage_of(after), usage_of(whole)
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):  # the second run meets a cache
        assert usage[field] == whole_usage[field], field
    # Charged once for the resumed request (and once for the uninterrupted one).
    until(lambda: day_used(endpoints, "resume-cut") == 2 * usage["total_tokens"], 20, "both settled")
    assert day_used(endpoints, "resume-cut") == 2 * usage["total_tokens"]


def test_only_the_team_or_the_token_reads_a_stream(dev_stack: Stack) -> None:
    stack, endpoints = dev_stack
    key, outsider = team_key(endpoints, "resume-owner"), team_key(endpoints, "resume-outsider")
    seen, path = cut_after(stack.ingress_urls[0], key, 5)
    url = stack.ingress_urls[1] + path.split("?")[0]
    assert httpx.get(url, headers={"Authorization": f"Bearer {outsider}"}).status_code == 404
    assert httpx.get(url).status_code == 401, "neither a key nor the token"
    assert httpx.get(url + "?token=" + "x" * 43).status_code == 404
    as_text = url.replace("/v1/chat/completions/chatcmpl-", "/v1/completions/cmpl-")
    assert httpx.get(as_text, headers={"Authorization": f"Bearer {key}"}).status_code == 404, "not a text one"
    assert (
        httpx.get(url, headers={"Authorization": f"Bearer {key}", "Last-Event-ID": "nine"}).status_code == 400
    )
    with httpx.stream("GET", stack.ingress_urls[1] + path, headers={"Last-Event-ID": str(seen[-1][0])},
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        rest = list(events(r.iter_lines()))
    assert rest[-1][1] == "[DONE]", "the token alone reads it, as a browser's EventSource does"
    assert int(str(rest[0][0])) == int(str(seen[-1][0])) + 1
    # Ended, and the client has it all: 204, which stops an EventSource coming back.
    done = httpx.get(url, headers={"Authorization": f"Bearer {key}", "Last-Event-ID": str(rest[-1][0])})
    assert done.status_code == 204
    again = httpx.get(url, headers={"Authorization": f"Bearer {key}", "Last-Event-ID": str(rest[-3][0])})
    assert [line for line in again.text.splitlines() if line.startswith("id:")] == [
        f"id: {rest[-2][0]}",
        f"id: {rest[-1][0]}",
    ], "an ended stream is read again from its log"


def test_a_stream_never_resumed_is_cancelled_after_the_grace_period(dev_stack: Stack) -> None:
    _, endpoints = dev_stack
    key = team_key(endpoints, "resume-gone")
    seen, _ = cut_after(endpoints.url, key, 3)
    rid = request_id_of(seen)
    # Within the grace period (5 s) the request runs on: its log grows past what the client read.
    read = len(text_of(seen))
    until(
        lambda: logged_tokens(endpoints, rid) > read + 10, 4, "the request running on after its client left"
    )
    log = until(lambda: terminal_log(endpoints, rid), 20, "the request's terminal chunk")
    end = log[-1]
    assert isinstance(end, ErrorChunk), end
    assert end.code == ErrorCode.CANCELLED
    generated = sum(e.num_tokens for e in log if isinstance(e, TokenChunk))
    assert generated < 200, "stopped before its end"
    assert day_used(endpoints, "resume-gone") == len(chat_prompt_ids(MESSAGES)) + generated


def logged_tokens(endpoints: Endpoints, rid: str) -> int:
    """Output tokens in the request's replay log so far."""

    async def go() -> int:
        redis = aioredis.Redis.from_url(endpoints.redis_url)
        try:
            log = await read_log(redis, Names(), rid)
        finally:
            await redis.aclose()
        return sum(e.num_tokens for e in log if isinstance(e, TokenChunk))

    return asyncio.run(go())
