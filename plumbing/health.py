"""Liveness of a process's background loops, and the count of items its loops ended alone.

Each long-running loop is watched: its task (a task that ended is dead) and, where it has a rhythm, the
time it last made a round (a loop that stopped advancing is stuck). `/healthz` of every service answers
503 while any watched loop is dead or stuck, and names it. A loop that meets an error in one item ends
that item (dead letter, failed batch line, error chunk) and counts it in `sluice_items_failed_total`.

The dispatcher and the worker serve /healthz beside /metrics from one small HTTP server
(`serve_metrics_and_health`); ingress and the scaler add the route to their own apps.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, make_wsgi_app

ITEMS_FAILED = Counter(
    "sluice_items_failed_total",
    "Items a long-running loop ended alone because handling them raised (the loop went on)",
    ["loop"],
)


def item_failed(loop: str) -> None:
    ITEMS_FAILED.labels(loop).inc()


@dataclass
class _Watched:
    task: asyncio.Task[Any] | None
    stale_after_s: float | None
    beat_at: float


class Liveness:
    """The loops of one process. `watch` a loop's task, `beat` each round; `report` says which are dead
    (their task ended) or stuck (no round for `stale_after_s`). Read from another thread by the health
    server: every update replaces whole entries."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._loops: dict[str, _Watched] = {}

    def watch(
        self, name: str, task: asyncio.Task[Any] | None = None, stale_after_s: float | None = None
    ) -> None:
        self._loops[name] = _Watched(task, stale_after_s, self._clock())

    def beat(self, name: str) -> None:
        watched = self._loops.get(name)
        if watched is not None:
            watched.beat_at = self._clock()

    def forget(self, name: str) -> None:
        self._loops.pop(name, None)

    def report(self) -> tuple[bool, dict[str, str]]:
        """(healthy, each loop's state: 'ok', 'dead' or 'stuck')."""
        now = self._clock()
        states: dict[str, str] = {}
        for name, watched in list(self._loops.items()):
            states[name] = loop_state(watched.task is not None and watched.task.done(), now - watched.beat_at,
                                      watched.stale_after_s)  # fmt: skip
        return all(s == "ok" for s in states.values()), states


def loop_state(task_done: bool, since_beat_s: float, stale_after_s: float | None) -> str:
    if task_done:
        return "dead"
    if stale_after_s is not None and since_beat_s > stale_after_s:
        return "stuck"
    return "ok"


def health_body(liveness: Liveness, extra: Iterable[tuple[str, bool]] = ()) -> tuple[int, dict[str, Any]]:
    """The status code and body of /healthz: 200 and 'ok' while every loop and extra check is ok."""
    healthy, loops = liveness.report()
    checks = dict(extra)
    healthy = healthy and all(checks.values())
    body: dict[str, Any] = {"status": "ok" if healthy else "degraded", "loops": loops}
    if checks:
        body["checks"] = {name: "ok" if ok else "failing" for name, ok in checks.items()}
    return (200 if healthy else 503), body


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics_and_health(port: int, addr: str, liveness: Liveness) -> WSGIServer:
    """/healthz from `liveness` and everything else from Prometheus's registry, on a daemon thread."""
    metrics_app = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            code, body = health_body(liveness)
            status = "200 OK" if code == 200 else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]
        result: Iterable[bytes] = metrics_app(environ, start_response)
        return result

    # The address's own family, so an IPv6 host ("::") binds as it did with start_http_server.
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

    class Server(_ThreadingServer):
        address_family = family

    server = make_server(addr, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-health", daemon=True).start()
    return server
