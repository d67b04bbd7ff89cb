"""`sluice batch submit` with a 1,000-line OpenAI batch file: dispatchers and workers as real processes, one
dispatcher killed mid-batch, the command interrupted and resumed. Every custom_id is answered exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from infra.batch_file import request_id_for
from infra.keys import create_signing_key
from plumbing.clients import redis_client
from queue_schemas.settings import BusSettings
from queue_schemas.teams import TeamRecord
from tests.conftest import Bus, read_dead_letters
from tests.integration.helpers import Services, create_topics, keys_to_end, leased, produce, wait_workers
from tests.integration.test_failover import POOL_FILE
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(300)

LINES = 1000
MALFORMED = {17: "{not json", 250: json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}})}
REFUSED = {40: {"n": 3}, 600: {"temperature": 9}}  # valid lines the dispatcher answers with a 400


POISON = [b'{"v": 1, "request_id": "trunc', b'{"v": 1, "kind": "answer"}', b'{"v": 7}']


def batch_file(path: Path) -> None:
    rows = []
    for i in range(LINES):
        if i in MALFORMED:
            rows.append(MALFORMED[i])
            continue
        body = {
            "model": "sluice-sim",
            "messages": [{"role": "user", "content": f"item {i}"}],
            "max_tokens": 8,
        }
        body.update(REFUSED.get(i, {}))
        rows.append(
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    path.write_text("\n".join(rows) + "\n")


def output_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines of an output file the submitter may be writing (a last line without its
    newline is still being written)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(t) for t in text[: text.rfind("\n") + 1].splitlines() if t.strip()]


async def wait_for_lines(path: Path, at_least: int, within_s: float) -> None:
    async def enough() -> bool:
        return len(output_lines(path)) >= at_least

    await eventually(enough, within_s, f"{at_least} answers in {path.name}")


async def keys_on(settings: BusSettings, topic: str) -> Counter[bytes]:
    """The key of every message on `topic`, read from the start."""
    return await keys_to_end(settings.kafka_bootstrap, topic)


async def whereabouts(settings: BusSettings, redis: Any, source: Path, output: Path) -> str:
    """For each valid line without an answer: how often its request is on the batch topic, and its
    placement and started records in Redis."""
    answered = {str(line["custom_id"]) for line in output_lines(output)}
    state = json.loads(output.with_name(output.name + ".state.json").read_text())
    missing = [i for i in range(LINES) if i not in MALFORMED and f"c{i}" not in answered]
    on_topic = await keys_on(settings, settings.names.batch_topic("sim"))
    said = []
    for i in missing[:5]:
        rid = request_id_for(state["batch_id"], i)
        placed = await redis.get(settings.names.placement(rid))
        started = await redis.get(settings.names.started(rid))
        said.append(
            f"c{i} ({rid}): on the topic {on_topic[rid.encode()]}x, placed {placed!r}, started {started!r}"
        )
    return f"{len(missing)} lines unanswered: " + "; ".join(said)


async def test_a_thousand_lines_survive_a_dispatcher_kill_and_an_interrupted_submitter(
    bus: Bus, tmp_path: Path
) -> None:
    settings = bus.settings()
    names = settings.names
    await create_topics(
        settings,
        names.requests_topic("sim"),
        names.batch_topic("sim"),
        names.deadletter_topic(),
        partitions=4,
    )
    services = Services(settings, tmp_path, POOL_FILE.format(token_ms=2, max_running=32))
    redis = redis_client(settings)
    await redis.set(names.team("acme"), TeamRecord(team="acme").model_dump_json())
    pem, _ = await create_signing_key(redis, names, "acme")
    (tmp_path / "acme.pem").write_text(pem)
    services.env["SLUICE_SIGNING_KEY_FILE"] = str(tmp_path / "acme.pem")
    source, output = tmp_path / "batch.jsonl", tmp_path / "batch.output.jsonl"
    batch_file(source)
    cli = [sys.executable, "-m", "infra.cli", "batch", "submit", str(source), "--team", "acme"]
    try:
        for i in range(2):
            services.start(f"dispatcher-{i}", "dispatcher", "--pool", "sim")
        for i in range(2):
            services.start(f"worker-{i}", "worker", "--pool", "sim", "--worker-id", f"w{i}")
        await wait_workers(redis, settings, ["w0", "w1"])
        await leased(redis, settings, [names.requests_topic("sim"), names.batch_topic("sim")], 4, 2)

        first = await asyncio.create_subprocess_exec(
            *cli, env=services.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await wait_for_lines(output, 150, 60)
        services.kill9("dispatcher-0")
        await wait_for_lines(output, 400, 60)
        first.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(first.wait(), 30) == 130, "an interrupted run says so with status 130"
        interrupted_at = len(output_lines(output))
        assert interrupted_at < LINES
        # Records on the reply topic that are not answers: the collector dead-letters them and goes on.
        await produce(settings, [(names.results_topic("acme"), p) for p in POISON])

        try:
            second = await asyncio.to_thread(
                subprocess.run, cli, env=services.env, capture_output=True, text=True, timeout=180
            )
        except subprocess.TimeoutExpired as exc:  # say where each line still unanswered got to
            raise AssertionError(await whereabouts(settings, redis, source, output)) from exc
        assert second.returncode == 0, second.stdout + second.stderr
        assert f"{LINES - 4} completed, 4 failed, 0 pending" in second.stdout

        lines = output_lines(output)
        counts = Counter(str(line["custom_id"]) for line in lines)
        assert len(lines) == LINES
        assert set(counts.values()) == {1}
        by_id = {str(line["custom_id"]): line for line in lines}
        assert by_id["line-18"]["error"]["code"] == "invalid_line"
        assert "not valid JSON" in by_id["line-18"]["error"]["message"]
        assert "custom_id" in str(by_id["line-251"]["error"])
        for i in REFUSED:
            assert by_id[f"c{i}"]["response"]["status_code"] == 400
        ok = [line for line in lines if line["response"] and line["response"]["status_code"] == 200]
        assert len(ok) == LINES - 4

        # Resuming submitted nothing twice: the batch topic holds one message per valid line.
        submitted = await keys_on(settings, names.batch_topic("sim"))
        assert len(submitted) == LINES - len(MALFORMED)
        assert set(submitted.values()) == {1}
        letters = await read_dead_letters(
            settings.kafka_bootstrap,
            names,
            at_least=len(POISON),
            wanted=lambda letter: letter.source == names.results_topic("acme"),
        )
        assert sorted(letter.payload for letter in letters) == sorted(p.decode() for p in POISON)
        assert all(
            letter.reason and letter.consumer.startswith(names.batch_collector_groups("acme"))
            for letter in letters
        )
        status = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "infra.cli", "batch", "status", str(output)],
            env={**os.environ, **services.env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (
            f"total={LINES}\tsubmitted={LINES}\tcompleted={LINES - 4}\tfailed=4\tpending=0" in status.stdout
        )
    finally:
        services.stop()
        await redis.aclose()
