"""Service logs: tracebacks show where, never what (no local variables, so no prompt, body or key)."""

from __future__ import annotations

import json
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


TRACED = """
import json
import structlog
from plumbing import tracing
from plumbing.clients import configure_logging
from queue_schemas.settings import BusSettings

# The timeline recorder has no Redis to write to here; only the log lines are read.
configure_logging(BusSettings(log_json=True, trace_timeline=True, redis_url="redis://127.0.0.1:9/0"), "probe")
log = structlog.get_logger("probe")
log.info("outside")
span = tracing.start("work", None)
with tracing.current(span):
    log.info("inside a span")
with tracing.logging_for("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"):
    log.info("a held request")
print("span", tracing.traceparent_of(span))
"""


def test_a_log_line_of_a_traced_request_carries_its_trace_id() -> None:
    run = subprocess.run(
        [sys.executable, "-c", TRACED], capture_output=True, text=True, timeout=60, check=True
    )
    lines = {}
    span_trace = ""
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            lines[event["event"]] = event
        elif line.startswith("span "):
            span_trace = line.split("-")[1]
    assert "trace_id" not in lines["outside"]
    assert lines["inside a span"]["trace_id"] == span_trace
    assert lines["a held request"]["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
