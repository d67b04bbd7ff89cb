"""The dashboard's JSON and `sluice lag`'s tables, from scaler reports."""

from __future__ import annotations

from collections import deque

from rich.console import Console

from infra.lag_cli import decision_lines, pool_rows, render, worker_rows
from scaler.burrow import Status
from scaler.dashboard import Sample, dashboard_body, sample_of
from scaler.lag import PoolLag
from scaler.policy import PoolSignals, Verdict
from scaler.service import PoolReport
from tests.unit.test_scaler_parts import beat


def report(lag: int, ready: int, workers: int = 2) -> PoolReport:
    beats = [
        beat(f"w{i}", running=3, waiting=1, inbox_pending=1, completed_per_s=1.5, kv_blocks_free=4,
             prefix_query_tokens=200, prefix_hit_tokens=150, sent_at=1000.0 - i, preemptions=7 * i
        ).model_copy(update={"adapters": ("sql", "poem")[:i]})
        for i in range(workers)
    ]  # fmt: skip
    signals = PoolSignals(1000.0, lag + 5, 2.5, 0.0, ready, 1, 0, 2.0, 120.0)
    verdict = Verdict("up", ready + 2, ready + 2, 3.0, "forecast above capacity")
    lag_read = PoolLag("chat", "requests.chat", "dispatch.chat", {0: lag}, 999.5)
    batch = PoolLag("chat", "batch.chat", "dispatch.chat", {0: 4, 1: 3}, 999.5)
    moves = {"moved": 3, "refused": 1}
    return PoolReport(lag_read, Status.WARN, {0: Status.WARN}, signals, verdict, 5, True, beats, batch, moves)


def test_dashboard_body_carries_pool_figures_history_and_workers() -> None:
    history = deque([sample_of(report(0, 1), 990.0), sample_of(report(12, 2), 1000.0)])
    body = dashboard_body({"chat": report(12, 2)}, {"chat": history}, 1001.0)
    (pool,) = body["pools"]
    assert pool["pool"] == "chat"
    assert pool["lag"] == 12
    assert pool["batch_lag"] == 7
    assert pool["status"] == "WARN"
    assert pool["backlog"] == 17
    assert pool["arrival_rate"] == 2.5
    assert pool["completion_rate"] == 3.0  # two workers at 1.5/s
    assert pool["replicas"] == {"ready": 2, "starting": 1, "draining": 0, "desired": 4}
    assert pool["spec_decoding"] is True
    assert pool["migrations"] == {"moved": 3, "refused": 1}
    assert [s["lag"] for s in pool["history"]] == [0, 12]
    assert pool["history"][1] == {
        "t": 1000.0, "lag": 12, "batch_lag": 7, "backlog": 17, "arrival": 2.5, "completion": 3.0,
        "ready": 2, "starting": 1, "draining": 0, "desired": 4,
    }  # fmt: skip
    w0, w1 = pool["workers"]
    assert w0["worker"] == "w0"
    assert w0["kv_used"] == 0.6  # 4 of 10 blocks free
    assert w0["waiting"] == 2  # engine queue plus undelivered inbox entries
    assert w0["prefix_hit"] == 0.75
    assert w1["heartbeat_age_s"] == 2.0
    assert (w0["preemptions"], w1["preemptions"]) == (0, 7)
    assert (w0["adapters"], w1["adapters"]) == ([], ["sql"])


def test_a_worker_without_lookups_or_blocks_shows_no_ratio() -> None:
    r = report(0, 1, workers=1)
    r.workers[0] = beat("idle", kv_blocks_total=0, kv_blocks_free=0)
    (pool,) = dashboard_body({"chat": r}, {}, 1000.0)["pools"]
    assert pool["workers"][0]["kv_used"] is None
    assert pool["workers"][0]["prefix_hit"] is None
    assert pool["history"] == []


def test_lag_tables_show_the_same_numbers() -> None:
    body = dashboard_body(
        {"chat": report(12, 2)}, {"chat": [Sample(1.0, 12, 7, 17, 2.5, 3.0, 2, 1, 0, 4)]}, 1001.0
    )
    (row,) = pool_rows(body)
    assert row == ["chat", "12", "WARN", "17", "7", "2.50", "3.00", "2/4 +1", "on"]
    assert decision_lines(body) == ["chat: up, forecast above capacity"]
    workers = worker_rows(body)
    assert [w[:7] for w in workers] == [
        ["chat", "w0", "ready", "60%", "3", "2", "75%"],
        ["chat", "w1", "ready", "60%", "3", "2", "75%"],
    ]
    console = Console(width=160, record=True)
    console.print(render(body))
    text = console.export_text()
    assert "chat: up, forecast above capacity" in text
    assert "w1" in text
    empty = Console(width=160, record=True)
    empty.print(render({"now": 0.0, "pools": []}))
    assert "has not read any pool yet" in empty.export_text()


def test_lag_tables_fit_an_80_column_terminal_without_squashing_the_numbers() -> None:
    r = report(12_345, 2)
    r.workers[0] = beat("chat-worker-with-a-long-generated-id-7f3a9c", running=3, kv_blocks_free=4)
    body = dashboard_body({"a-pool-with-a-long-name": r}, {}, 1001.0)
    console = Console(width=80, record=True)
    console.print(render(body))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    pool_header = next(line for line in lines if "status" in line)
    for column in ("lag", "status", "backlog", "batch", "in/s", "done/s", "replicas", "spec"):
        assert column in pool_header.split(), f"{column} is cut or wrapped in: {pool_header!r}"
    worker_header = next(line for line in lines if "state" in line)
    for column in ("state", "KV", "run", "wait", "hits", "tok/s", "age"):
        assert column in worker_header.split()
    assert any("12345" in line and "WARN" in line and "2/4 +1" in line for line in lines)
    decision = [line for line in lines if "forecast above capacity" in line]
    assert len(decision) == 1  # the decision has its own line, not a wrapped column


def test_each_worker_shows_the_predicted_ttft_of_a_typical_request_and_the_models_error() -> None:
    r = report(0, 1, workers=2)
    r.workers[0] = r.workers[0].model_copy(
        update={"prefill_backlog": 0, "prefill_tokens_per_s": 4096.0, "step_s": 0.02, "ttft_error": 0.12}
    )
    r.workers[1] = r.workers[1].model_copy(
        update={
            "prefill_backlog": 7680,
            "prefill_tokens_per_s": 4096.0,
            "step_s": 0.02,
            "ttft_correction": 2.0,
        }
    )
    (pool,) = dashboard_body({"chat": r}, {}, 999.0)["pools"]  # w1's heartbeat is 0 s old then
    w0, w1 = pool["workers"]
    # 512 tokens at 4,096/s, half the step in progress and one step per 2,048-token chunk.
    assert w0["predicted_ttft_s"] == round(0.01 + 0.125 + 0.02, 4)
    assert w0["ttft_error"] == 0.12
    # Behind 7,680 queued tokens: 8,192 at 4,096/s and four chunks, doubled by the worker's correction.
    assert w1["predicted_ttft_s"] == round(2 * (0.01 + 2.0 + 0.08), 4)
    assert w1["prefill_backlog"] == 7680
