"""The pure parts of tracing (plumbing.tracing and each service's part), the dashboard's timeline, and the
dev stack's supervision of its processes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

from dispatcher.table import runner_up
from gpu_workers.coalesce import ChunkCoalescer
from gpu_workers.engine import EngineOutput
from gpu_workers.tracing import RequestSpans, entry_time
from infra.devstack import DevStack, InfraLost, restart_delay
from infra.launcher import spawn
from plumbing import tracing
from queue_schemas.codec import encode
from queue_schemas.messages import FinalChunk, FinishReason, InferenceRequest, SamplingParams, TokenChunk
from queue_schemas.settings import BusSettings
from queue_schemas.usage import Timing
from scaler.dashboard import slowest, timeline_body
from tests.unit.test_codec import make_request

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_only_a_version_00_traceparent_is_continued() -> None:
    assert tracing.valid_traceparent(TRACEPARENT) == TRACEPARENT
    assert tracing.valid_traceparent(TRACEPARENT.encode()) == TRACEPARENT
    for bad in ("", "00-zz", TRACEPARENT.upper(), "01" + TRACEPARENT[2:], TRACEPARENT + "-extra", None, 7):
        assert tracing.valid_traceparent(bad) is None, bad


def test_record_headers_are_read_as_untrusted() -> None:
    assert tracing.header_traceparent([("tracestate", b"a=1"), ("traceparent", TRACEPARENT.encode())]) == (
        TRACEPARENT
    )
    assert tracing.header_traceparent([("traceparent", b"\xff\xfe")]) is None
    assert tracing.header_traceparent(None) is None


def test_an_unset_traceparent_is_left_off_the_wire() -> None:
    chunk = TokenChunk(request_id="r" * 16, seq=0, text="a", num_tokens=1)
    assert b"traceparent" not in encode(chunk)
    assert b"traceparent" in encode(chunk.model_copy(update={"traceparent": TRACEPARENT}))


def test_a_message_refuses_a_malformed_traceparent() -> None:
    fields = {
        "request_id": "r" * 16, "pool": "sim", "model": "m", "team": "t", "prompt_token_ids": (1,),
        "sampling": SamplingParams(max_tokens=4), "created_at": 1.0, "deadline": 2.0,
    }  # fmt: skip
    assert InferenceRequest(**fields, traceparent=TRACEPARENT).traceparent == TRACEPARENT  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        InferenceRequest(**fields, traceparent="00-not-a-trace")  # type: ignore[arg-type]


def test_tracing_is_wanted_only_with_an_endpoint_or_the_timeline() -> None:
    off = BusSettings()
    timeline = BusSettings(trace_timeline=True)
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert not tracing.wanted(off, {})
    assert tracing.wanted(off, endpoint)
    assert tracing.wanted(off, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.wanted(timeline, {})
    assert not tracing.wanted(off, {**endpoint, "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.wanted(timeline, {**endpoint, "OTEL_SDK_DISABLED": "true"})


def test_the_worker_span_goes_back_on_the_first_chunk_and_the_final_one() -> None:
    coalescer = ChunkCoalescer("r" * 16, "w0", flush_after_s=0.0)
    coalescer.traceparent = TRACEPARENT
    chunks = [coalescer.add(EngineOutput(f"t{i} ", 1, None, 3), float(i)) for i in range(3)]
    final = coalescer.add(EngineOutput("end", 1, FinishReason.STOP, 3), 4.0)
    assert all(isinstance(c, TokenChunk) for c in chunks)
    assert [c.traceparent for c in chunks if c is not None] == [TRACEPARENT, None, None]
    assert isinstance(final, FinalChunk)
    assert final.traceparent == TRACEPARENT


def test_the_runner_up_is_the_next_best_fit_worker() -> None:
    score = np.array([0.2, 0.9, -np.inf, 0.7])
    assert runner_up(score, 1, higher=True) == 3
    predicted = np.array([0.5, np.inf, 0.1, 0.3])
    assert runner_up(predicted, 2, higher=False) == 3
    assert runner_up(np.array([1.0, -np.inf]), 0, higher=True) is None


def test_an_inbox_entry_is_dated_by_its_id() -> None:
    assert entry_time(b"1700000000123-0") == pytest.approx(1_700_000_000.123)
    assert entry_time(b"odd") is None


def test_a_span_of_a_request_becomes_a_timeline_entry() -> None:
    tracer = TracerProvider().get_tracer("test")
    parent = tracer.start_span("placement", start_time=tracing.ns(10.0))
    child = tracer.start_span(
        "inbox",
        context=tracing.child_context(parent),
        start_time=tracing.ns(10.5),
        attributes={tracing.REQUEST_ID: "req-123456", tracing.WORKER: "w0"},
    )
    child.end(tracing.ns(10.75))
    entry = tracing.timeline_entry(child, "worker")  # type: ignore[arg-type]
    assert entry is not None
    assert entry["request_id"] == "req-123456"
    assert (entry["start"], entry["end"]) == (10.5, 10.75)
    assert entry["parent_id"] == f"{parent.get_span_context().span_id:016x}"
    assert entry["attributes"] == {tracing.WORKER: "w0"}
    anonymous = tracer.start_span("other")
    anonymous.end()
    assert tracing.timeline_entry(anonymous, "worker") is None  # type: ignore[arg-type]


def _entry(name: str, span: str, parent: str | None, start: float, end: float, root: bool = False) -> str:
    attributes = {"sluice.root": True} if root else {}
    return json.dumps({
        "name": name, "service": "s", "span_id": span, "parent_id": parent, "trace_id": "t",
        "start": start, "end": end, "attributes": attributes,
    })  # fmt: skip


def test_the_timeline_orders_spans_and_sums_the_leaves() -> None:
    raw = [
        _entry("decode", "d", "g", 100.5, 101.0),
        _entry("request", "r", None, 100.0, 101.0, root=True),
        "not json",
        _entry("generate", "g", "r", 100.2, 101.0),
        _entry("prefill", "p", "g", 100.2, 100.5),
        json.dumps({"name": "no times"}),
    ]
    body = timeline_body("rid", raw)
    assert [s["name"] for s in body["spans"]] == ["request", "generate", "prefill", "decode"]
    assert [s["depth"] for s in body["spans"]] == [0, 1, 2, 2]
    assert body["total_ms"] == pytest.approx(1000.0)
    assert body["spans"][2]["offset_ms"] == pytest.approx(200.0)
    assert body["hops"] == {"prefill": pytest.approx(300.0), "decode": pytest.approx(500.0)}
    assert timeline_body("rid", []) == {"request_id": "rid", "spans": [], "hops": {}}


def test_the_slowest_recent_requests_come_first() -> None:
    members = [(b"a 100.0", 0.5), (b"b 101.0", 2.0), (b"c 10.0", 9.0), (b"junk", 5.0), ("d 102.5", 1.0)]
    rows = slowest(members, since=50.0, limit=2)
    assert [r["request_id"] for r in rows] == ["b", "d"]
    assert rows[0] == {"request_id": "b", "seconds": 2.0, "ended_at": 101.0}


def test_restart_back_off_doubles_to_a_cap() -> None:
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert restart_delay(20) == 30.0


def test_a_service_that_exits_is_restarted_after_its_back_off(tmp_path: Path) -> None:
    dev = DevStack(tmp_path)
    dev.processes.append(spawn("svc", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path))
    dev.processes[0].popen.wait(10)
    now = time.monotonic()
    dev.supervision.started["svc"] = now
    assert dev.supervise(now) == ["svc exited (3); restarting in 0.5 s"]
    assert dev.supervise(now + 0.1) == [], "not before its back-off"
    assert dev.supervise(now + 0.6) == ["svc restarted (1 so far)"]
    assert dev.supervision.restarts["svc"] == 1
    dev.processes[0].popen.wait(10)
    assert dev.supervise(now + 1.0) == ["svc exited (3); restarting in 1 s"], "a second exit in a row"
    dev.processes.append(spawn("redis", [sys.executable, "-c", "pass"], tmp_path))
    dev.processes[-1].popen.wait(10)
    with pytest.raises(InfraLost, match="redis exited"):
        dev.supervise(now + 5.0)


def test_a_workers_spans_end_when_its_last_chunk_left(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "ENABLED", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    request = make_request(traceparent=TRACEPARENT)
    spans = RequestSpans(request, b"100000-0", "w0", began=100.5)
    spans.finish(Timing(began=100.5, first_token=101.0, ended=102.0), "ok", 5, None)
    ended = {span.name: (span.start_time, span.end_time) for span in exporter.get_finished_spans()}
    assert ended == {
        "inbox": (tracing.ns(100.0), tracing.ns(100.5)),
        "prefill": (tracing.ns(100.5), tracing.ns(101.0)),
        "decode": (tracing.ns(101.0), tracing.ns(102.0)),
        "generate": (tracing.ns(100.5), tracing.ns(102.0)),
    }
    unstamped = RequestSpans(request, b"100000-0", "w0", began=100.5)
    before = time.time()
    unstamped.finish(Timing(began=100.5, first_token=101.0), "ok", 5, None)
    generate = [s for s in exporter.get_finished_spans() if s.name == "generate"][-1]
    assert generate.end_time is not None
    assert generate.end_time >= tracing.ns(before)  # no stamp: ended as it finishes
