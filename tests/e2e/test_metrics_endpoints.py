"""Every Prometheus endpoint of the running dev stack, as Prometheus's own linter reads it."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from infra.devstack import DevStack, Endpoints
from tests.e2e.conftest import openai_client
from tests.tools import promtool

pytestmark = pytest.mark.timeout(120)


def test_every_metrics_endpoint_passes_promtool(dev_stack: tuple[DevStack, Endpoints]) -> None:
    stack, endpoints = dev_stack
    # One answered request first, so the request, placement and latency series have samples.
    done = openai_client(endpoints).chat.completions.create(
        model="sluice-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    assert done.choices[0].message.content
    # Each ingress, the scaler, and each pool's dispatchers.
    assert len(stack.metrics_urls) == len(stack.ingress_urls) + 1 + stack.dispatchers * len(
        stack.config.pools
    )
    for url in stack.metrics_urls:
        exposition = httpx.get(url, timeout=10).text
        assert "# TYPE" in exposition, url
        checked = subprocess.run(
            [promtool(), "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=30
        )
        assert checked.returncode == 0, (url, checked.stdout + checked.stderr)
