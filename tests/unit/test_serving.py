"""An HTTP service binds its port before it builds its app, and a taken port ends it with its name."""

from __future__ import annotations

import socket

import pytest

from plumbing.serving import bind_listener

pytestmark = pytest.mark.unit


def test_a_taken_port_is_named_in_the_exit_message() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as ended:
            bind_listener("ingress", "127.0.0.1", port)
    assert str(ended.value) == f"sluice ingress: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_the_port_is_held_and_refuses_connections_until_served() -> None:
    with bind_listener("scaler", "127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
