from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.devstack import DevStack, Endpoints


@pytest.fixture(scope="session")
def dev_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, Endpoints]]:
    """The same embedded stack `make run` starts: broker, Redis and every service as processes."""
    stack = DevStack(tmp_path_factory.mktemp("stack"), ingress_port=None)
    endpoints = stack.start()
    try:
        yield stack, endpoints
    finally:
        stack.stop()


@pytest.fixture
def endpoints(dev_stack: tuple[DevStack, Endpoints]) -> Endpoints:
    return dev_stack[1]
