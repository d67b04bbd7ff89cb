"""Ports chosen for the stack's servers stay theirs until they bind them."""

from __future__ import annotations

import socket

import pytest

from infra.devstack import ingress_ports
from infra.launcher import free_port, free_ports, port_is_free

pytestmark = pytest.mark.unit


def held(port: int) -> bool:
    """Whether another process's probe for a free port (a plain bind) is refused the port."""
    return not port_is_free(port)


def test_a_free_port_is_held_from_others_and_open_to_its_server() -> None:
    port = free_port()
    assert held(port), "another process's probe for a free port is refused it"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as every server here sets it
        server.bind(("127.0.0.1", port))
        server.listen()


def test_outgoing_connections_never_take_a_held_port() -> None:
    reserved = set(free_ports(100))
    assert len(reserved) == 100
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        used: set[int] = set()
        for _ in range(4):  # 4 x 500 local ports the kernel chose
            conns = [socket.create_connection(listener.getsockname()) for _ in range(500)]
            used |= {c.getsockname()[1] for c in conns}
            accepted = [listener.accept()[0] for _ in conns]
            for s in [*conns, *accepted]:
                s.close()
    assert len(used) >= 1000, "the kernel chose many different ports"
    assert not used & reserved


def test_ingress_ports_are_the_asked_for_run_or_held_ones() -> None:
    # Below the kernel's range for outgoing connections, so the pair stays free while the test runs.
    first = next(p for p in range(20000, 30000, 2) if port_is_free(p) and port_is_free(p + 1))
    assert ingress_ports(first, 2) == [first, first + 1]
    for anywhere in (None, 0):  # `sluice dev --port 0` asks for any
        chosen = ingress_ports(anywhere, 3)
        assert len(set(chosen)) == 3
        assert all(held(p) for p in chosen)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        instead = ingress_ports(busy, 2)
    assert busy not in instead
    assert all(held(p) for p in instead)
