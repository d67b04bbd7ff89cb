"""Running an HTTP service (the ingress, the scaler) on a socket bound before its app is built.

uvicorn binds its port only after the app's start-up (tokenizers, broker and Redis connections), which
takes minutes on a loaded machine: a port chosen for the service could be taken meanwhile, and a port
that was taken was reported only after all of that. Binding first keeps the port from the start and
ends a process whose port is taken at once, before anything is loaded or connected.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

STARTUP_FAILURE = 3  # uvicorn's exit status for a server that did not start


def bind_listener(service: str, host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (not yet listening: connections are refused until the app is up).
    A port that cannot be bound ends the process with a message that names it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"sluice {service}: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def serve(app: Any, sock: socket.socket, **options: Any) -> None:
    """Serve `app` on `sock` until a signal stops it; a server that failed to start exits non-zero."""
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **options))
    server.run(sockets=[sock])
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
