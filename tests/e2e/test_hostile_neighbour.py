"""Attacks by one team on the service others use, each alone, then all together: one team throws what
the services cannot carry at every entry while another team streams chats and runs a batch. Every hostile
input is refused (a 4xx, or a dead letter for a Kafka record); no process exits; the calm team's streams
and batch complete with the exact simulated answers, and no ingress's event loop is held by hostile input.

A held loop is read from each ingress's `sluice_event_loop_busy_cpu_seconds`: the loop thread's CPU time
between two ticks, which a callback that holds the loop inflates and a host short of cores does not. Figures
(that histogram, the largest gap between two chunks of the calm team's streams, Redis memory, ingress memory)
are printed; run with `-s` to see them."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from infra.devstack import DevStack, Endpoints
from infra.keys import create_signing_key
from queue_schemas.names import Names
from queue_schemas.signing import load_private_key, sign_record
from tests.conftest import read_dead_letters
from tests.e2e.conftest import FAST_STATE, openai_client, team_key
from tests.e2e.test_batch_api import FINAL, chat_line, expected_text, jsonl, read_file, wait_for

pytestmark = pytest.mark.timeout(300)

STREAM_TOKENS = 48
# The most CPU time an ingress's loop thread may spend between two of its 20 ms ticks during an attack.
# Hostile input handled on the loop crosses it many times over (the 64 MiB upload scanned on the loop
# instead of the upload threads holds it for about a second); a busy host does not add to CPU time.
MAX_LOOP_BUSY_CPU_S = 0.5
# A loop held without using CPU (a blocking call on it) does not show in CPU time; a gap this long between
# two chunks of a calm stream catches that, far above the 250-750 ms the scheduler alone leaves on two cores.
STALL_BACKSTOP_S = 5.0
DEEP = 300
BIG_UPLOAD_BYTES = 64 * 1024 * 1024
LINE_OVER_A_RECORD = 1024 * 1024 + 4096  # past a Kafka record's default 1 MiB
MAX_RSS_GROWTH_KIB = 100 * 1024
FILES_CAP = int(FAST_STATE["SLUICE_FILES_PER_TEAM"])
BATCHES_CAP = int(FAST_STATE["SLUICE_BATCHES_PER_TEAM"])


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"k": [value]}
    return value


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "sluice-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(path, what, raw JSON body) of each hostile HTTP body: surrogates are escapes, as a client sends."""
    chat, text, responses = "/v1/chat/completions", "/v1/completions", "/v1/responses"
    schema = {"type": "json_schema", "name": "s", "schema": nested(DEEP)}
    batch = {"input_file_id": "file-x", "endpoint": chat, "completion_window": "24h"}
    bodies: list[tuple[str, str, Any]] = [
        (chat, "stop surrogate", chat_body(stop=["\ud800"])),
        (chat, "content surrogate", chat_body(messages=[{"role": "user", "content": "a\udfff"}])),
        (chat, "key surrogate", chat_body(metadata={"\ud800": "v"})),
        (chat, "NaN", chat_body(temperature=float("nan"))),
        (chat, "overflow float", chat_body(top_p=1.0)),
        (chat, "seed past int64", chat_body(seed=2**70)),
        (chat, "deep nesting", chat_body(metadata=nested(DEEP))),
        (text, "prompt surrogate", {"model": "sluice-sim", "prompt": "\ud800", "max_tokens": 4}),
        (responses, "input surrogate", {"model": "sluice-sim", "input": "\udbff"}),
        (responses, "deep schema", {"model": "sluice-sim", "input": "x", "text": {"format": schema}}),
        ("/v1/batches", "metadata surrogate", {**batch, "metadata": {"k": "\ud800"}}),
    ]
    raw = [(path, what, json.dumps(body).encode()) for path, what, body in bodies]
    return [(p, w, b.replace(b'"top_p": 1.0', b'"top_p": 1e999')) for p, w, b in raw]


def hostile_files() -> list[tuple[str, bytes]]:
    """(what, file) of each hostile upload: every one is refused at upload."""
    ok = json.dumps(chat_line("ok", "fine")) + "\n"

    def row(**over: Any) -> str:
        line = chat_line("r", "x")
        line.update(over)
        return json.dumps(line) + "\n"

    long = chat_line("long", "x" * LINE_OVER_A_RECORD)
    return [
        ("custom_id surrogate", (ok + row(custom_id="\ud800")).encode()),
        ("body nested deep", (ok + row(body={"model": "sluice-sim", "metadata": nested(DEEP)})).encode()),
        ("stop surrogate", (ok + json.dumps(chat_line("s", "x", stop=["\ud800"])) + "\n").encode()),
        ("NaN", (ok + json.dumps(chat_line("n", "x", temperature=float("nan"))) + "\n").encode()),
        ("line over the limit", (ok + json.dumps(long) + "\n").encode()),
        ("not UTF-8", ok.encode() + b'{"custom_id": "\xff"}\n'),
    ]


def hostile_records(team: str) -> list[tuple[str, bytes]]:
    """(what, value) of a hostile team's own signed Kafka batch records."""

    def record(**body: Any) -> dict[str, Any]:
        return {
            "v": 1,
            "request_id": f"r-{len(body)}",
            "custom_id": "c",
            "team": team,
            "body": chat_body(**body),
        }

    return [
        ("stop surrogate", json.dumps(record(stop=["\ud800"])).encode()),
        ("deep nesting", json.dumps(record(metadata=nested(DEEP))).encode()),
        ("NaN", json.dumps(record(temperature=float("nan"))).encode()),
        ("custom_id surrogate", json.dumps({**record(), "custom_id": "\udfff"}).encode()),
    ]  # fmt: skip


class CalmTeam:
    """Streams chats until told to stop, recording the largest gap between two chunks of a stream."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.stop = threading.Event()
        self.max_gap_s = 0.0
        self.streams = 0
        self.wrong: list[str] = []

    def stream_once(self, n: int) -> None:
        content = f"calm question {n}"
        stream = self.client.chat.completions.create(
            model="sluice-sim", messages=[{"role": "user", "content": content}], max_tokens=STREAM_TOKENS,
            stream=True,
        )  # fmt: skip
        text, last = "", None
        for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].delta.content:
                if last is not None:
                    self.max_gap_s = max(self.max_gap_s, now - last)
                last = now
                text += chunk.choices[0].delta.content
        if text != expected_text(content, STREAM_TOKENS):
            self.wrong.append(content)
        self.streams += 1

    def run(self, worker: int) -> None:
        n = worker * 1000
        while not self.stop.is_set():
            self.stream_once(n)
            n += 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def loop_ticks_over(stack: DevStack, bound_s: float = MAX_LOOP_BUSY_CPU_S) -> dict[str, int]:
    """Per ingress, how many of its loop's ticks so far came after more than `bound_s` of loop CPU time."""
    over: dict[str, int] = {}
    for url in stack.ingress_urls:
        samples = {
            (sample.name, sample.labels.get("le")): sample.value
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
            if family.name == "sluice_event_loop_busy_cpu_seconds"
            for sample in family.samples
        }
        count = samples[("sluice_event_loop_busy_cpu_seconds_count", None)]
        assert count > 0, f"{url} reports no loop ticks"
        over[url] = int(count - samples[("sluice_event_loop_busy_cpu_seconds_bucket", str(bound_s))])
    return over


def ticks_over_since(
    before: dict[str, int], stack: DevStack, bound_s: float = MAX_LOOP_BUSY_CPU_S
) -> dict[str, int]:
    after = loop_ticks_over(stack, bound_s)
    return {url: after[url] - before[url] for url in after if after[url] != before[url]}


def ingress_rss_kib(stack: DevStack) -> int:
    return sum(rss_kib(p.popen.pid) for p in stack.processes if p.name.startswith("ingress") and p.alive)


async def produce_signed(endpoints: Endpoints, team: str, records: list[tuple[str, bytes]]) -> None:
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        pem, _ = await create_signing_key(redis, Names(), team)
    finally:
        await redis.aclose()
    private = load_private_key(pem)
    producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap)
    await producer.start()
    try:
        for _, value in records:
            await producer.send_and_wait(
                Names().batch_topic("sim"), value, headers=sign_record(private, value)
            )
    finally:
        await producer.stop()


async def redis_memory(endpoints: Endpoints) -> int:
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        return int((await redis.info("memory"))["used_memory"])
    finally:
        await redis.aclose()


def hostile_run(endpoints: Endpoints, key: str, stack: DevStack) -> dict[str, Any]:
    """Every hostile input, once; what each got back."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    answers: dict[str, int] = {}
    with httpx.Client(base_url=endpoints.url, headers=headers, timeout=60) as http:
        for path, what, raw in hostile_bodies():
            answers[f"{path} {what}"] = http.post(path, content=raw).status_code
    client = openai_client(endpoints, key, timeout=120)
    for what, data in hostile_files():
        try:
            client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
            answers[f"/v1/files {what}"] = 200
        except openai.APIStatusError as exc:
            answers[f"/v1/files {what}"] = exc.status_code
    # A large valid upload, streamed through while the calm team streams; then files up to the cap.
    line = (json.dumps(chat_line("big-{n}", "y" * 1400, model="no-such-model")) + "\n").encode()
    count = BIG_UPLOAD_BYTES // len(line)
    big = b"".join(line.replace(b"big-{n}", f"big-{n}".encode()) for n in range(count))
    rss_before = ingress_rss_kib(stack)
    upload = client.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    rss_growth = ingress_rss_kib(stack) - rss_before
    unknown = jsonl([chat_line(f"u-{n}", "z", model="no-such-model") for n in range(200)])
    kept = [upload.id]
    capped: int | None = None
    for _ in range(20):
        try:
            kept.append(client.files.create(file=("u.jsonl", io.BytesIO(unknown)), purpose="batch").id)
        except openai.APIStatusError as exc:
            capped = exc.status_code
            break
    answers["/v1/files past the team's file cap"] = capped or 200
    for file_id in kept[-4:]:  # room for batches and their result files
        client.files.delete(file_id)
    batch_cap: int | None = None
    for file_id in kept[1:-4]:
        try:
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        except openai.APIStatusError as exc:
            batch_cap = exc.status_code
            break
    answers["/v1/batches past the team's batch cap"] = batch_cap or 200
    asyncio.run(produce_signed(endpoints, "hostile", hostile_records("hostile")))
    return {"answers": answers, "ingress_rss_growth_kib": rss_growth, "big_upload_bytes": len(big)}


def in_threads(*jobs: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def chat_answers(endpoints: Endpoints, key: str, content: str) -> None:
    """One chat on the default pool, answered with its exact simulated text."""
    client = openai_client(endpoints, key, timeout=30)
    answer = client.chat.completions.create(
        model="sluice-sim", messages=[{"role": "user", "content": content}], max_tokens=16
    )
    assert answer.choices[0].message.content == expected_text(content, 16)


def small_batch(endpoints: Endpoints, team: str) -> None:
    """A three-line batch of another team, completed with its exact answers."""
    client = openai_client(endpoints, team_key(endpoints, team), timeout=30)
    lines = [chat_line(f"{team}-{n}", f"{team} asks {n}") for n in range(3)]
    upload = client.files.create(file=("ok.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_for(client, batch.id, lambda b: b.status in FINAL, 60)
    assert done.status == "completed"
    output = {line["custom_id"]: line for line in read_file(client, done.output_file_id)}
    for n in range(3):
        body = output[f"{team}-{n}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == expected_text(f"{team} asks {n}")


def upload_status(client: openai.OpenAI, data: bytes) -> int:
    try:
        client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_attack_1_a_signed_record_the_models_cannot_encode_is_dead_lettered(
    dev_stack: tuple[DevStack, Endpoints],
) -> None:
    stack, endpoints = dev_stack
    team_key(endpoints, "signer")
    value = dict(hostile_records("signer"))["stop surrogate"]
    asyncio.run(produce_signed(endpoints, "signer", [("stop surrogate", value)]))

    async def letter() -> list[str]:
        letters = await read_dead_letters(
            endpoints.kafka_bootstrap, Names(), at_least=1, wanted=lambda x: x.payload == value.decode()
        )
        return [x.reason for x in letters]

    reasons = asyncio.run(letter())
    assert reasons, "the record was not dead-lettered"
    assert "lone surrogate" in reasons[0]
    chat_answers(endpoints, team_key(endpoints, "after-record"), "still placing?")
    assert stack.dead() == [], f"processes exited: {[p.name for p in stack.dead()]}"


def test_attack_2_a_poisoned_file_is_refused_and_batches_keep_moving(
    dev_stack: tuple[DevStack, Endpoints],
) -> None:
    stack, endpoints = dev_stack
    client = openai_client(endpoints, team_key(endpoints, "poisoner"), timeout=30)
    for what, data in hostile_files():
        assert upload_status(client, data) == 400, what
    small_batch(endpoints, "bystander")
    assert stack.dead() == []


def test_attack_3_a_large_upload_neither_stalls_streams_nor_fills_memory(
    dev_stack: tuple[DevStack, Endpoints],
) -> None:
    stack, endpoints = dev_stack
    calm = CalmTeam(openai_client(endpoints, team_key(endpoints, "streamer"), timeout=60))
    client = openai_client(endpoints, team_key(endpoints, "uploader"), timeout=120)
    line = json.dumps(chat_line("big-{n}", "y" * 1400, model="no-such-model")) + "\n"
    held_before, busy_before = loop_ticks_over(stack), loop_ticks_over(stack, 0.05)
    data = "".join(line.replace("big-{n}", f"big-{n}") for n in range(32 * 2**20 // len(line))).encode()

    def upload_and_batch() -> tuple[int, list[str]]:
        try:
            before = ingress_rss_kib(stack)
            upload = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
            batches = [
                client.batches.create(
                    input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
                ).id
                for _ in range(2)
            ]
            time.sleep(2.0)  # the keeper validates and starts sending both while the streams go on
            return ingress_rss_kib(stack) - before, batches
        finally:
            calm.stop.set()

    *_, (growth_kib, batches) = in_threads(lambda: calm.run(0), lambda: calm.run(1), upload_and_batch)
    for batch_id in batches:
        client.batches.cancel(batch_id)
    print(
        f"\nlarge upload: {len(data) / 2**20:.0f} MiB and two batches from it; {calm.streams} streams, "
        f"largest gap {calm.max_gap_s * 1000:.0f} ms; ingress memory grew {growth_kib / 1024:.0f} MiB; "
        f"loop ticks after over 50 ms of loop CPU {ticks_over_since(busy_before, stack, 0.05)}"
    )
    assert calm.wrong == []
    assert calm.streams >= 2
    assert ticks_over_since(held_before, stack) == {}, "an ingress's event loop was held by the upload"
    assert calm.max_gap_s < STALL_BACKSTOP_S
    assert growth_kib < MAX_RSS_GROWTH_KIB


def test_attack_4_files_and_batches_stop_at_the_team_caps(dev_stack: tuple[DevStack, Endpoints]) -> None:
    _, endpoints = dev_stack
    client = openai_client(endpoints, team_key(endpoints, "hoarder"), timeout=30)
    unknown = jsonl([chat_line(f"u-{n}", "z", model="no-such-model") for n in range(50)])

    def upload() -> Any:
        return client.files.create(file=("u.jsonl", io.BytesIO(unknown)), purpose="batch")

    files = [upload() for _ in range(FILES_CAP)]
    assert all(f.expires_at is not None and f.expires_at > f.created_at for f in files)
    with pytest.raises(openai.BadRequestError) as refused:
        upload()
    assert refused.value.code == "limit_reached"

    def create(file_id: str) -> Any:
        return client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    # At its file cap a team cannot start a batch: its result files would have no room.
    with pytest.raises(openai.BadRequestError, match="room for its result files") as refused:
        create(files[0].id)
    assert refused.value.code == "limit_reached"
    for file in files[-4:]:  # deleted files free their places
        client.files.delete(file.id)
    for file in files[:BATCHES_CAP]:
        create(file.id)
    # The next one passes a cap: the batches in progress, or the files (with the result files written).
    with pytest.raises(openai.BadRequestError) as refused:
        create(files[BATCHES_CAP].id)
    assert refused.value.code == "limit_reached"
    upload()


def test_attack_5_a_line_larger_than_a_record_is_refused_at_upload(
    dev_stack: tuple[DevStack, Endpoints],
) -> None:
    _, endpoints = dev_stack
    client = openai_client(endpoints, team_key(endpoints, "long-liner"), timeout=30)
    data = dict(hostile_files())["line over the limit"]
    with pytest.raises(openai.BadRequestError, match="Line 2"):
        client.files.create(file=("long.jsonl", io.BytesIO(data)), purpose="batch")
    small_batch(endpoints, "after-long-line")


def test_a_hostile_team_cannot_stop_the_service_for_another(dev_stack: tuple[DevStack, Endpoints]) -> None:
    stack, endpoints = dev_stack
    calm_key, hostile_key = team_key(endpoints, "calm"), team_key(endpoints, "hostile")
    calm = CalmTeam(openai_client(endpoints, calm_key, timeout=60))
    batch_client = openai_client(endpoints, calm_key, timeout=60)
    lines = [chat_line(f"calm-{n}", f"Calm batch question {n}?") for n in range(20)]
    upload = batch_client.files.create(file=("calm.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    memory_before = asyncio.run(redis_memory(endpoints))
    held_before, busy_before = loop_ticks_over(stack), loop_ticks_over(stack, 0.05)

    def calm_batch() -> Any:
        batch = batch_client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        return wait_for(batch_client, batch.id, lambda b: b.status in FINAL, 240)

    def hostile() -> dict[str, Any]:
        try:
            return hostile_run(endpoints, hostile_key, stack)
        finally:
            calm.stop.set()

    streams = [lambda w=w: calm.run(w) for w in range(3)]
    _, _, _, finished, found = in_threads(*streams, calm_batch, hostile)

    refused = {what: status for what, status in found["answers"].items() if not 400 <= status < 500}
    assert refused == {}, f"hostile inputs not refused with a 4xx: {refused}"
    ours = asyncio.run(
        read_dead_letters(
            endpoints.kafka_bootstrap,
            Names(),
            at_least=len(hostile_records("hostile")),
            wanted=lambda letter: '"team": "hostile"' in letter.payload,
        )
    )
    reasons = sorted(letter.reason for letter in ours)
    assert len(ours) == len(hostile_records("hostile")), reasons
    assert all(("surrogate" in r or "deeper" in r or "finite" in r) for r in reasons), reasons
    assert stack.dead() == [], f"processes exited: {[p.name for p in stack.dead()]}"
    assert calm.streams >= 3
    assert calm.wrong == []
    assert finished.status == "completed", finished
    output = {line["custom_id"]: line for line in read_file(batch_client, finished.output_file_id)}
    assert sorted(output) == sorted(line["custom_id"] for line in lines)
    for n in range(20):
        body = output[f"calm-{n}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == expected_text(f"Calm batch question {n}?")
    memory_after = asyncio.run(redis_memory(endpoints))
    print(
        f"\nhostile neighbour: {calm.streams} calm streams, largest gap between chunks "
        f"{calm.max_gap_s * 1000:.0f} ms; Redis used_memory {memory_before / 2**20:.1f} -> "
        f"{memory_after / 2**20:.1f} MiB; a {found['big_upload_bytes'] / 2**20:.0f} MiB upload grew the "
        f"ingresses by {found['ingress_rss_growth_kib'] / 1024:.0f} MiB; loop ticks after over 50 ms of loop "
        f"CPU {ticks_over_since(busy_before, stack, 0.05)}; answers {found['answers']}"
    )
    assert ticks_over_since(held_before, stack) == {}, "an ingress's event loop was held by hostile input"
    assert calm.max_gap_s < STALL_BACKSTOP_S, f"a calm stream stalled {calm.max_gap_s * 1000:.0f} ms"
    # What the hostile team leaves in Redis is bounded by its caps (records of at most FILES_CAP files and
    # BATCHES_CAP batches of 200 lines); the bytes of its uploads, the large one included, live in the file
    # store, never in Redis.
    assert memory_after - memory_before < found["big_upload_bytes"] // 2, "an upload's bytes landed in Redis"
