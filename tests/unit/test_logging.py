"""Service logs: tracebacks show where, never what (no local variables, so no prompt, body or key)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
import structlog
from plumbing.clients import configure_logging
from queue_schemas.settings import BusSettings

configure_logging(BusSettings(log_json=sys.argv[1] == "json"), "probe")

def serve(body: str) -> None:
    request_body = {"messages": [{"role": "user", "content": body}]}
    raise ValueError("the engine refused it")

try:
    serve(sys.argv[2])
except ValueError:
    structlog.get_logger("probe").error("request failed", exc_info=True)
"""


@pytest.mark.parametrize("mode", ["console", "json"])
def test_tracebacks_carry_no_local_variables(mode: str) -> None:
    canary = "canary-7f3a9c"
    run = subprocess.run(
        [sys.executable, "-c", PROBE, mode, canary], capture_output=True, text=True, timeout=60, check=True
    )
    logged = run.stdout + run.stderr
    assert "Traceback" in logged
    assert "the engine refused it" in logged
    assert canary not in logged
