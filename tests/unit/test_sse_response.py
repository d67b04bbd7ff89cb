"""A completion stream's SSE response (ingress.sse_response), driven as an ASGI server drives it: what
sse-starlette's response gives a stream (headers, frames as made, keep-alive pings, the end of the
stream on a disconnect, a send timeout when one is set), with no cancel scope opened per send."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import Message

from ingress.resume import STREAM_HEADER, Ping, sse_frame
from ingress.sse_response import SseResponse

SCOPE = {"type": "http", "method": "GET", "path": "/", "headers": []}


class Client:
    """The server's side of one response: what was sent, and a disconnect when the test says so."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def body(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def headers_of(message: Message) -> dict[bytes, bytes]:
    return dict(message["headers"])


async def frames(count: int, done: list[str]) -> AsyncIterator[bytes]:
    try:
        for n in range(count):
            yield sse_frame(f'{{"n":{n}}}', str(n))
    finally:
        done.append("closed")


async def test_the_stream_has_sse_starlettes_headers_and_frames_as_made() -> None:
    headers = {STREAM_HEADER: "/v1/chat/completions/x/stream?token=t"}
    ours, theirs = Client(), Client()
    await SseResponse(frames(3, []), ping=15, headers=headers, ping_message_factory=Ping)(
        SCOPE, ours.receive, ours.send
    )
    await EventSourceResponse(frames(3, []), ping=15, headers=headers, ping_message_factory=Ping)(
        SCOPE, theirs.receive, theirs.send
    )
    assert ours.sent == theirs.sent
    start = headers_of(ours.sent[0])
    assert start[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert start[b"cache-control"] == b"no-store"
    assert start[b"connection"] == b"keep-alive"
    assert start[b"x-accel-buffering"] == b"no"
    assert start[STREAM_HEADER.encode()] == headers[STREAM_HEADER].encode()
    assert ours.body() == [sse_frame(f'{{"n":{n}}}', str(n)) for n in range(3)] + [b""]
    assert ours.sent[-1]["more_body"] is False


async def test_no_cancel_scope_is_opened_per_send(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = 0
    move_on_after: Callable[..., Any] = anyio.move_on_after

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal opened
        opened += 1
        return move_on_after(*args, **kwargs)

    monkeypatch.setattr(anyio, "move_on_after", counted)
    client = Client()
    await SseResponse(frames(100, []), ping=15)(SCOPE, client.receive, client.send)
    assert len(client.body()) == 101
    assert opened == 0
    await EventSourceResponse(frames(100, []), ping=15)(SCOPE, Client().receive, Client().send)
    assert opened >= 100, "sse-starlette's own response opens one a send (what this one saves)"


async def test_a_quiet_stream_gets_a_ping_comment_every_keepalive() -> None:
    async def quiet() -> AsyncIterator[bytes]:
        yield sse_frame("first", "0")
        await asyncio.sleep(0.35)
        yield sse_frame("last", "1")

    client = Client()
    await SseResponse(quiet(), ping=0.1, ping_message_factory=Ping)(SCOPE, client.receive, client.send)
    body = client.body()
    assert body[0] == sse_frame("first", "0")
    assert body[-2:] == [sse_frame("last", "1"), b""]
    pings = body[1:-2]  # about three: the loop may run late, never early
    assert pings, "a ping while nothing else is sent"
    assert set(pings) == {b": ping\r\n"}, "a comment line alone, never an empty event"


async def test_a_client_that_leaves_ends_the_stream_and_its_cleanup_runs() -> None:
    done: list[str] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            yield sse_frame("first", "0")
            await asyncio.Event().wait()
            yield b"never"
        finally:
            done.append("closed")

    client = Client()
    serving = asyncio.create_task(SseResponse(endless(), ping=15)(SCOPE, client.receive, client.send))
    await asyncio.sleep(0.05)
    client.gone.set()
    await asyncio.wait_for(serving, 5)
    assert done == ["closed"]
    assert client.body() == [sse_frame("first", "0")], "no closing send to a client that left"


async def test_a_send_timeout_still_applies_when_set() -> None:
    done: list[str] = []

    class Stalled(Client):
        async def send(self, message: Message) -> None:
            if message["type"] == "http.response.body":
                await asyncio.Event().wait()
            await super().send(message)

    client = Stalled()
    response = SseResponse(frames(3, done), ping=15, send_timeout=0.05)
    with pytest.raises(SendTimeoutError):
        await asyncio.wait_for(response(SCOPE, client.receive, client.send), 5)
    assert done == ["closed"]
