"""One trace per request across processes, and a dev stack that survives a dead process.

`sluice dev` runs as a user runs it, with every service exporting OTLP/HTTP to a receiver on loopback in
this test (bench.otlp_sink), so the spans cross process boundaries as they do to a real collector. Then its
processes are killed one by one: each comes back and new requests succeed. A second `sluice dev` with
`--exit-on-failure` stops when one of its processes is killed.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis as sync_redis

from bench.otlp_sink import OtlpSink, ReceivedSpan
from plumbing.processes import child_pids
from queue_schemas.names import Names
from tests.e2e.dev_cli import DevRun, pid_alive, sluice_dev
from tests.waiting import until

pytestmark = pytest.mark.timeout(420)

MODEL = "sluice-sim"
CHAT_ROOT = "POST /v1/chat/completions"  # the ingress's server span of a chat completion
WORDS = 60
POOLS = f"""
[[pools]]
name = "sim"
model = "{MODEL}"
default_max_tokens = 400
[pools.simulated]
ttft_ms = 20
token_ms = 25
min_words = {WORDS}
max_words = {WORDS}
[pools.scaling]
min_replicas = 2
max_replicas = 2
startup_s = 5
"""
SERVER, PRODUCER, CONSUMER = 2, 4, 5  # OTLP span kinds
MAX_GAP_S = 0.005


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def dev_run(tmp_path_factory: pytest.TempPathFactory, sink: OtlpSink) -> Iterator[DevRun]:
    tmp = tmp_path_factory.mktemp("traced")
    config = tmp / "pools.toml"
    config.write_text(POOLS)
    with sluice_dev(tmp, "--config", str(config), env=sink.env()) as run:
        yield run


def client(run: DevRun) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=run.env["SLUICE_URL"] + "/v1", api_key=run.env["SLUICE_API_KEY"], max_retries=0
    )


def stream_chat(run: DevRun, content: str, max_tokens: int) -> tuple[str, str]:
    """(request id, text) of one streamed chat."""
    with client(run) as c:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], stream=True, max_tokens=max_tokens
        )
        chunks = list(stream)
    return chunks[0].id.removeprefix("chatcmpl-"), "".join(
        ch.choices[0].delta.content or "" for ch in chunks if ch.choices
    )


def wait_spans(
    sink: OtlpSink, request_id: str, done: Callable[[list[ReceivedSpan]], bool]
) -> list[ReceivedSpan]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = sink.of_request(request_id)
        if done(spans):
            return spans
        time.sleep(0.2)
    raise AssertionError(
        f"spans of {request_id} incomplete: {sorted(s.name for s in sink.of_request(request_id))}"
    )


def has(*names: str) -> Callable[[list[ReceivedSpan]], bool]:
    return lambda spans: set(names) <= {s.name for s in spans}


def widest_gap(spans: list[ReceivedSpan]) -> tuple[float, str]:
    """The longest stretch between the first span's start and the last one's end that no span covers, in
    seconds, and the spans on either side of it."""
    ordered = sorted(spans, key=lambda s: s.start_ns)
    covered_to, before = ordered[0].end_ns, ordered[0].name
    gap, where = 0.0, ""
    for s in ordered[1:]:
        if s.start_ns > covered_to and (s.start_ns - covered_to) / 1e9 > gap:
            gap, where = (s.start_ns - covered_to) / 1e9, f"{before} .. {s.name}"
        if s.end_ns > covered_to:
            covered_to, before = s.end_ns, s.name
    return gap, where


def test_a_streamed_chat_is_one_trace_from_admission_to_the_last_token(
    dev_run: DevRun, sink: OtlpSink
) -> None:
    request_id, text = stream_chat(dev_run, "trace me", max_tokens=40)
    assert text
    # Every span asserted on below: each service exports in batches, so one may come a batch later.
    named = has(CHAT_ROOT, "admission", "relay", "placement", "inbox", "generate", "prefill", "decode")
    spans = wait_spans(sink, request_id, lambda s: named(s) and {PRODUCER, CONSUMER} <= {x.kind for x in s})
    assert len({s.trace_id for s in spans}) == 1, "one trace"
    by_id = {s.span_id: s for s in spans}

    def up(span: ReceivedSpan) -> ReceivedSpan:
        assert span.parent_id in by_id, f"{span.name}'s parent is in the trace"
        return by_id[span.parent_id]

    (root,) = [s for s in spans if s.parent_id is None]
    assert (root.service, root.kind, root.name) == ("sluice-ingress", SERVER, CHAT_ROOT)
    assert root.attributes["sluice.request_id"] == request_id
    assert root.attributes["sluice.team"] == "dev"
    assert root.attributes["http.response.status_code"] == 200
    assert {s.service for s in spans} == {"sluice-ingress", "sluice-dispatcher", "sluice-worker"}

    def parent(name: str) -> ReceivedSpan:
        (span,) = [s for s in spans if s.name == name]
        return up(span)

    assert parent("admission") is root
    assert parent("relay") is root
    (sent,) = [s for s in spans if s.kind == PRODUCER]
    assert up(sent) is root
    assert sent.attributes["messaging.destination.name"].endswith("requests.sim")
    (received,) = [s for s in spans if s.kind == CONSUMER]
    assert up(received) is sent, "the dispatcher continues the context in the record's headers"
    assert received.service == "sluice-dispatcher"
    placement = next(s for s in spans if s.name == "placement")
    assert up(placement) is sent
    assert placement.attributes["sluice.worker"].startswith("sim-w")
    assert "sluice.placement.score" in placement.attributes
    assert placement.attributes["sluice.placement.runner_up"].startswith("sim-w"), "two workers: a runner-up"
    generate = parent("prefill")
    assert generate.name == "generate"
    assert parent("decode") is generate
    assert up(generate) is placement, "the worker continues the placement's span"
    assert parent("inbox") is placement
    assert generate.attributes["sluice.worker"] == placement.attributes["sluice.worker"]
    assert generate.attributes["gen_ai.usage.output_tokens"] > 0
    relay = next(s for s in spans if s.name == "relay")
    assert relay.attributes["sluice.outcome"] == "ok"
    assert relay.attributes["sluice.worker_span"].split("-")[2] == generate.span_id, (
        "the final chunk names it"
    )
    # Admission to the last token: the spans below the root leave no stretch over 5 ms unaccounted for.
    gap, where = widest_gap([s for s in spans if s is not root])
    assert gap <= MAX_GAP_S, f"{gap * 1000:.1f} ms between {where} is in no span"
    detail = [s for s in spans if s is not root]
    assert min(s.start_ns for s in detail) - root.start_ns < 50e6
    assert root.end_ns >= max(s.end_ns for s in detail) - 1e6


def test_a_client_traceparent_is_kept(dev_run: DevRun, sink: OtlpSink) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {
        "Authorization": f"Bearer {dev_run.env['SLUICE_API_KEY']}",
        "traceparent": f"00-{trace_id}-{parent_id}-01",
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "keep my trace"}], "max_tokens": 10}
    reply = httpx.post(
        dev_run.env["SLUICE_URL"] + "/v1/chat/completions", json=body, headers=headers, timeout=60
    )
    assert reply.status_code == 200, reply.text
    request_id = reply.json()["id"].removeprefix("chatcmpl-")
    spans = wait_spans(sink, request_id, has("relay", "decode", CHAT_ROOT))
    assert {s.trace_id for s in spans} == {trace_id}
    (root,) = [s for s in spans if s.kind == SERVER]
    assert root.parent_id == parent_id


def test_a_malformed_traceparent_starts_a_new_trace(dev_run: DevRun, sink: OtlpSink) -> None:
    headers = {"Authorization": f"Bearer {dev_run.env['SLUICE_API_KEY']}", "traceparent": "00-zz-not-a-trace"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "bad header"}], "max_tokens": 5}
    reply = httpx.post(
        dev_run.env["SLUICE_URL"] + "/v1/chat/completions", json=body, headers=headers, timeout=60
    )
    assert reply.status_code == 200, reply.text
    spans = wait_spans(sink, reply.json()["id"].removeprefix("chatcmpl-"), has("relay", CHAT_ROOT))
    (root,) = [s for s in spans if s.kind == SERVER]
    assert root.parent_id is None


def test_a_responses_api_request_is_one_trace(dev_run: DevRun, sink: OtlpSink) -> None:
    with client(dev_run) as c:
        response = c.responses.create(model=MODEL, input="trace a response", max_output_tokens=40)
    assert response.status == "incomplete", "the answer is longer than 40 tokens"
    assert response.output_text
    request_id = response.id.removeprefix("resp_")
    spans = wait_spans(sink, request_id, has("POST /v1/responses", "placement", "decode", "relay"))
    assert len({s.trace_id for s in spans}) == 1
    assert {s.service for s in spans} == {"sluice-ingress", "sluice-dispatcher", "sluice-worker"}
    (root,) = [s for s in spans if s.parent_id is None]
    assert root.name == "POST /v1/responses"
    assert root.attributes["sluice.outcome"] == "ok"


def test_a_batch_line_is_one_trace(dev_run: DevRun, sink: OtlpSink) -> None:
    line = {
        "custom_id": "traced-line", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "a batch line"}], "max_tokens": 8},
    }  # fmt: skip
    with client(dev_run) as c:
        upload = c.files.create(
            file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch"
        )
        batch = c.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {batch.status}"
            time.sleep(0.5)
            batch = c.batches.retrieve(batch.id)
    assert batch.status == "completed"

    def batch_lines() -> list[ReceivedSpan]:  # exported in the ingress's next span batch, soon after the end
        return [
            s
            for s in list(sink.spans)
            if s.name == "batch line" and s.attributes.get("sluice.batch_id") == batch.id
        ]

    lines = until(batch_lines, 15, "the batch line's span exported")
    time.sleep(1)  # a second one, were there one, would be exported with it or within a second
    assert len(batch_lines()) == len(lines) == 1
    request_id = lines[0].attributes["sluice.request_id"]
    spans = wait_spans(sink, request_id, has("batch line", "placement", "decode"))
    assert len({s.trace_id for s in spans}) == 1
    assert {s.service for s in spans} == {"sluice-ingress", "sluice-dispatcher", "sluice-worker"}
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_id in by_id for s in spans if s is not lines[0]), "every span under the line's"


def worker_pid(run: DevRun, worker_id: str) -> int:
    scaler = run.pids["scaler"]
    for pid in child_pids(scaler):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if worker_id.encode() in argv:
            return pid
    raise AssertionError(f"no process for worker {worker_id}")


def test_a_request_moved_off_a_killed_worker_is_one_trace(dev_run: DevRun, sink: OtlpSink) -> None:
    redis = sync_redis.Redis.from_url(dev_run.env["SLUICE_REDIS_URL"])
    names = Names(dev_run.env.get("SLUICE_PREFIX", "sluice"))
    texts: list[str] = []
    with client(dev_run) as c:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a long answer, moved"}], stream=True
        )
        request_id = ""
        for n, chunk in enumerate(stream):
            request_id = chunk.id.removeprefix("chatcmpl-")
            texts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if n == 5:
                owner = redis.get(names.placement(request_id))
                assert owner is not None
                assert isinstance(owner, bytes)
                os.kill(worker_pid(dev_run, owner.decode()), signal.SIGKILL)
    redis.close()
    assert len("".join(texts).split()) >= WORDS
    # The killed worker's own spans of the request end with it (those not yet exported are lost); the
    # second worker's are all there.
    moved = has("relay", "migration", "generate", "decode")
    spans = wait_spans(sink, request_id, lambda s: moved(s) and sum(x.name == "placement" for x in s) == 2)
    assert len({s.trace_id for s in spans}) == 1, "one trace across the move"
    (move,) = [s for s in spans if s.name == "migration"]
    assert move.service == "sluice-dispatcher"
    assert move.attributes["sluice.delivered_tokens"] > 0
    placements = [s for s in spans if s.name == "placement"]
    assert len({p.attributes["sluice.worker"] for p in placements}) == 2, "placed on a second worker"
    (generate,) = [s for s in spans if s.name == "generate"]
    assert generate.attributes["sluice.delivered_tokens"] > 0, (
        "the second worker went on from the tokens sent"
    )
    parents = {s.span_id: s.name for s in spans}
    assert parents.get(move.parent_id or "") == "placement", (
        "the move continues from the lost worker's placement"
    )


def wait(what: str, check: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:.0f} s")


def live_pids(run: DevRun) -> dict[str, int]:
    return {line.split()[0]: int(line.split()[1]) for line in (run.workdir / "pids").read_text().splitlines()}


def test_killed_processes_come_back_and_requests_go_on(dev_run: DevRun) -> None:
    url, scaler_url = dev_run.env["SLUICE_URL"], dev_run.env["SLUICE_SCALER_URL"]
    for name in ("ingress", "dispatcher-sim"):
        old = live_pids(dev_run)[name]
        os.kill(old, signal.SIGKILL)
        wait(f"{name} restarted", lambda: live_pids(dev_run).get(name, old) != old)  # noqa: B023
        assert pid_alive(live_pids(dev_run)[name])
    wait("the ingress answering", lambda: httpx.get(url + "/healthz", timeout=2).status_code == 200)
    workers = child_pids(dev_run.pids["scaler"])
    before = httpx.get(scaler_url + "/api/dashboard", timeout=2).json()["restarts"].get("workers of sim", 0)
    killed_at = time.time()
    os.kill(workers[0], signal.SIGKILL)

    def replaced() -> bool:
        body = httpx.get(scaler_url + "/api/dashboard", timeout=2).json()
        ready = [w for w in body["pools"][0]["workers"] if w["state"] == "ready" and w["heartbeat_age_s"] < 3]
        return (
            len(ready) == 2
            and body["restarts"].get("workers of sim", 0) == before + 1
            and len(child_pids(dev_run.pids["scaler"])) >= 2
        )

    wait("the killed worker replaced", replaced, 90)
    restarts = httpx.get(scaler_url + "/api/dashboard", timeout=2).json()["restarts"]
    assert restarts["ingress"] >= 1, restarts
    assert restarts["dispatcher-sim"] >= 1, restarts
    for n in range(4):
        _, text = stream_chat(dev_run, f"after the kills {n}", max_tokens=20)
        assert text
    log = dev_run.stderr_path.read_text()
    assert "ingress exited" in log
    assert "ingress restarted" in log
    assert time.time() - killed_at < 300


def test_exit_on_failure_stops_the_stack(tmp_path: Path) -> None:
    with sluice_dev(tmp_path, "--engine", "simulated", "--exit-on-failure") as run:
        os.kill(run.pids["ingress"], signal.SIGKILL)
        run.proc.wait(timeout=60)
        assert run.proc.returncode == 1
        assert "ingress exited" in run.stderr_path.read_text()
        assert not any(pid_alive(pid) for name, pid in run.pids.items() if name != "ingress")
