"""A steady load of streamed chat requests, run on its own thread, recording how each one ended.

Kinds of ending:
- ok: one final chunk with a finish_reason, text as long as usage.completion_tokens (the simulated engine
  spends one token per character, so a duplicated or lost chunk shows) and, where the load knows what an
  uninterrupted run answers, equal to it; the usage chunk, then [DONE];
- error: exactly one error event and nothing after it;
- refused / unavailable: not accepted (an HTTP error status, or no connection);
- cut: accepted, then the connection dropped before a terminal event;
- hung: no terminal event within the request's time;
- bad: anything else (two terminal events, events after one, a wrong length).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

REQUEST_LIMIT_S = 90.0


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    kind: str
    detail: str = ""
    ttft: float | None = None  # seconds from sending to the first content
    request_id: str = ""  # sluice's, from the chunks' id (empty when refused)
    completion_tokens: int | None = None  # from the usage chunk of a complete answer


def classify(lines: list[str], expected: str | None = None) -> tuple[str, str]:
    """The ending of one accepted stream from its `data:` payloads, in order; the stream has closed.
    With `expected`, a complete answer must also have exactly that text."""
    kind, detail = _ending(lines)
    if kind == "ok" and expected is not None:
        text = "".join(
            choice["delta"].get("content") or ""
            for data in lines
            if data != "[DONE]"
            for choice in json.loads(data).get("choices", [])
        )
        if text != expected:
            return "bad", f"text differs from an uninterrupted run: {text!r} != {expected!r}"
    return kind, detail


def _ending(lines: list[str]) -> tuple[str, str]:
    finishes = errors = 0
    text: list[str] = []
    usage: dict[str, int] | None = None
    after_end = False
    done = False
    for data in lines:
        if done or errors:
            after_end = True
            break
        if data == "[DONE]":
            done = True
            continue
        body = json.loads(data)
        if "error" in body:
            errors += 1
            continue
        if body.get("usage"):
            usage = body["usage"]
        for choice in body.get("choices", []):
            text.append(choice["delta"].get("content") or "")
            if choice.get("finish_reason"):
                finishes += 1
    if after_end or finishes + errors > 1:
        return "bad", f"{finishes} finishes, {errors} errors, data after the end: {after_end}"
    if errors:
        return "error", json.loads(lines[-1])["error"].get("code") or "error"
    if not finishes:
        return "cut", f"{len(lines)} events, no terminal one"
    if not done or usage is None:
        return "bad", "a finished stream without its usage chunk or [DONE]"
    if len("".join(text)) != usage["completion_tokens"]:
        return "bad", f"{len(''.join(text))} characters for {usage['completion_tokens']} tokens"
    return "ok", ""


def _note(seen: dict[str, Any], data: str) -> None:
    """The request id (from the chunk id) and the usage of a stream, as its events arrive."""
    if data == "[DONE]":
        return
    body = json.loads(data)
    if "id" in body and "id" not in seen:
        seen["id"] = str(body["id"]).removeprefix("chatcmpl-")
    if body.get("usage"):
        seen["completion"] = body["usage"]["completion_tokens"]


class Load:
    def __init__(
        self,
        url: str,
        api_key: str,
        model: str,
        clients: int,
        expected: Callable[[str], str] | None = None,
    ) -> None:
        """`expected(content)` is what an uninterrupted run answers to a user message, if known."""
        self._expected = expected
        self._url = url + "/v1/chat/completions"
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._model = model
        self._clients = clients
        self._outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._extra: list[concurrent.futures.Future[str]] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, n: int) -> None:
        """Send `n` more requests now, beside the steady clients, each once (from any thread)."""
        assert self._ready.wait(10), "the load is running"
        loop, http = self._loop, self._http
        assert loop is not None
        assert http is not None
        with self._lock:
            assert not self._stop.is_set(), "the load has stopped"  # else its outcome could be lost
            for _ in range(n):
                tag = f"extra-{len(self._extra)}"
                self._extra.append(asyncio.run_coroutine_threadsafe(self._attempt(http, tag), loop))

    def stop(self) -> list[Outcome]:
        """Stop sending; wait for the requests in flight to end; all outcomes."""
        self._stop.set()
        self._thread.join(REQUEST_LIMIT_S + 30)
        assert not self._thread.is_alive(), "the load's requests did not end"
        return self.outcomes()

    def outcomes(self) -> list[Outcome]:
        with self._lock:
            return list(self._outcomes)

    @staticmethod
    def tally(outcomes: list[Outcome]) -> dict[str, int]:
        return dict(collections.Counter(o.kind for o in outcomes))

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self._clients * 4)
        timeout = httpx.Timeout(REQUEST_LIMIT_S, connect=2.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            self._loop, self._http = asyncio.get_running_loop(), client
            self._ready.set()
            await asyncio.gather(*(self._client(client, k) for k in range(self._clients)))
            with self._lock:
                extra = [asyncio.wrap_future(f) for f in self._extra]
            await asyncio.gather(*extra)

    async def _client(self, client: httpx.AsyncClient, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            kind = await self._attempt(client, f"{k}-{n}")
            if kind in ("refused", "unavailable"):
                await asyncio.sleep(0.2)  # a client backing off while the service is down
            n += 1

    async def _attempt(self, client: httpx.AsyncClient, tag: str) -> str:
        """One request, its outcome recorded; how it ended."""
        started = time.time()
        first: list[float] = []
        seen: dict[str, Any] = {}
        try:
            kind, detail = await asyncio.wait_for(self._one(client, tag, first, seen), REQUEST_LIMIT_S)
        except TimeoutError:
            kind, detail = "hung", f"no terminal event within {REQUEST_LIMIT_S:.0f} s"
        ttft = first[0] - started if first else None
        with self._lock:
            self._outcomes.append(
                Outcome(started, time.time(), kind, detail, ttft, seen.get("id", ""), seen.get("completion"))
            )
        return kind

    async def _one(
        self, client: httpx.AsyncClient, tag: str, first: list[float], seen: dict[str, Any]
    ) -> tuple[str, str]:
        """One streamed request's ending; `seen` gets its request id and completion tokens."""
        content = f"chaos request {tag}"
        body = {
            "model": self._model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content}],
        }
        expected = self._expected(content) if self._expected is not None else None
        lines: list[str] = []
        try:
            async with client.stream("POST", self._url, json=body, headers=self._headers) as response:
                if response.status_code != 200:
                    return "refused", f"{response.status_code}: {(await response.aread())[:200]!r}"
                try:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line.removeprefix("data: "))
                            _note(seen, lines[-1])
                            if not first and '"content":"' in line and '"content":""' not in line:
                                first.append(time.time())
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    kind, detail = classify(lines, expected)
                    return (
                        ("cut", f"{type(exc).__name__} after {len(lines)} events")
                        if kind == "cut"
                        else (kind, detail)
                    )
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            return "unavailable", type(exc).__name__
        return classify(lines, expected)
