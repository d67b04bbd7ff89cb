"""An OTLP/HTTP trace receiver on loopback: what the services export, decoded from protobuf and kept in
memory (for the tracing tests), or only counted (for the tracing cost benchmark)."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int  # OTLP's SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return None if which is None else getattr(v, which)


def decode_export(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP export request (protobuf)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=service,
                        name=s.name,
                        kind=int(s.kind),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2,
                    )
                )
    return spans


class OtlpSink:
    """`with OtlpSink(keep=True) as sink:` serves http://127.0.0.1:<sink.port>/v1/traces."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.span_count = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode_export(body)
                with sink._lock:
                    sink.exports += 1
                    sink.span_count += len(spans)
                    if sink.keep:
                        sink.spans.extend(spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a service needs to export here, promptly."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }

    def of_request(self, request_id: str) -> list[ReceivedSpan]:
        """Every span of the traces in which some span names `request_id`."""
        with self._lock:
            spans = list(self.spans)
        traces = {s.trace_id for s in spans if s.attributes.get("sluice.request_id") == request_id}
        return [s for s in spans if s.trace_id in traces]

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    """`python -m bench.otlp_sink --port N`: count what arrives until SIGTERM, then print the count."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port-file", required=True, help="where to write the port it listens on")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with OtlpSink(keep=False) as sink:
        with open(args.port_file, "w") as f:
            f.write(str(sink.port))
        stop.wait()
        print(f"otlp sink: {sink.span_count} spans in {sink.exports} exports", flush=True)


if __name__ == "__main__":
    main()
