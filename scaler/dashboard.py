"""What the live dashboard and `sluice lag` show: pure functions from the scaler's reports to JSON.

The scaler keeps one `Sample` per pool and tick (the last `HISTORY_POINTS`), so the page can draw lag over
time without a metrics store; Prometheus and Grafana keep the long history.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from plumbing.latency import LatencyDefaults, heartbeat_ttft
from queue_schemas.messages import Heartbeat

if TYPE_CHECKING:
    from scaler.service import PoolReport

HISTORY_POINTS = 600  # ten minutes at the default one-second tick


@dataclass(frozen=True)
class Sample:
    t: float
    lag: int
    batch_lag: int | None
    backlog: int
    arrival: float
    completion: float
    ready: int
    starting: int
    draining: int
    desired: int


def sample_of(report: PoolReport, now: float) -> Sample:
    s = report.signals
    return Sample(
        t=round(now, 3),
        lag=report.lag.total,
        batch_lag=report.batch_lag.total if report.batch_lag is not None else None,
        backlog=s.backlog,
        arrival=round(s.arrival_rate, 3),
        completion=round(report.completion_rate, 3),
        ready=s.ready,
        starting=s.starting,
        draining=s.draining,
        desired=report.verdict.desired,
    )


def report_body(report: PoolReport) -> dict[str, Any]:
    """One pool as `/api/pools` serves it: every signal and the verdict of the last tick."""
    s, v = report.signals, report.verdict
    return {
        "pool": report.lag.pool,
        "lag": report.lag.total,
        "partitions": {str(p): lag for p, lag in report.lag.partitions.items()},
        "batch_lag": report.batch_lag.total if report.batch_lag is not None else None,
        "status": report.status.value,
        "partition_status": {str(p): st.value for p, st in report.partition_status.items()},
        "held": report.held,
        "backlog": s.backlog,
        "arrival_rate": round(s.arrival_rate, 3),
        "completion_rate": round(report.completion_rate, 3),
        "forecast_rate": round(v.forecast, 3),
        "replicas": {"ready": s.ready, "starting": s.starting, "draining": s.draining, "desired": v.desired},
        "capacity_per_replica": round(s.capacity_per_replica, 3),
        "startup_s": round(s.startup_s, 1),
        "decision": {"action": v.action, "target": v.target, "reason": v.reason},
        "spec_decoding": report.spec_decoding,
        "migrations": dict(sorted(report.migrations.items())),
        "handoffs": handoff_figures(report.handoffs),
        "read_at": report.lag.read_at,
    }


def handoff_figures(totals: Mapping[str, int]) -> dict[str, Any]:
    """A pool's prefill/decode handoffs: how many, how many fell back to a local prefill, the mean wait."""
    loaded, fallback = totals.get("loaded", 0), totals.get("fallback", 0)
    count = loaded + fallback
    mean = totals.get("wait_ms", 0) / count / 1000 if count else None
    return {"disaggregated": count, "fallbacks": fallback, "mean_handoff_s": mean}


TYPICAL_UNCACHED = 512  # prompt tokens to compute, for the predicted TTFT the dashboard shows


def typical_ttft(hb: Heartbeat, now: float) -> float:
    """The placement's predicted time to first token on the worker for a request with 512 uncached
    prompt tokens (plumbing.latency, with the default priors where the worker has not measured)."""
    return heartbeat_ttft(hb, TYPICAL_UNCACHED, now, LatencyDefaults())[0]


def worker_row(hb: Heartbeat, now: float) -> dict[str, Any]:
    """One worker's line: KV use, running and waiting requests, prefix-cache hits, LoRA adapters held,
    and the latency model's prediction for a typical request there with its recent error."""
    total = hb.kv_blocks_total
    return {
        "worker": hb.worker_id,
        "state": hb.state,
        "role": hb.role,
        "kv_used": round(1 - hb.kv_blocks_free / total, 4) if total else None,
        "running": hb.running,
        "waiting": hb.waiting + hb.inbox_pending,
        "prefix_hit": round(hb.prefix_hit_tokens / hb.prefix_query_tokens, 4)
        if hb.prefix_query_tokens
        else None,
        "decode_tokens_per_s": round(hb.decode_tokens_per_s, 1),
        "prefill_tokens_per_s": round(hb.prefill_tokens_per_s, 1),
        "prefill_backlog": hb.prefill_backlog,
        "predicted_ttft_s": round(typical_ttft(hb, now), 4),
        "ttft_error": round(hb.ttft_error, 4),
        "completed_per_s": round(hb.completed_per_s, 3),
        "preemptions": hb.preemptions,
        "adapters": list(hb.adapters),
        "spec_decoding": hb.spec_decoding,
        "heartbeat_age_s": round(max(0.0, now - hb.sent_at), 2),
    }


def dashboard_body(
    reports: Mapping[str, PoolReport], history: Mapping[str, Sequence[Sample]], now: float
) -> dict[str, Any]:
    """Everything the dashboard draws, per pool: the latest report, its history and its workers."""
    pools = []
    for name, report in reports.items():
        body = report_body(report)
        body["history"] = [asdict(sample) for sample in history.get(name, ())]
        body["workers"] = [worker_row(hb, now) for hb in sorted(report.workers, key=lambda h: h.worker_id)]
        pools.append(body)
    return {"now": now, "pools": pools}


def timeline_body(request_id: str, raw: Sequence[bytes | str]) -> dict[str, Any]:
    """A request's recorded spans (plumbing.tracing's timeline entries) as the dashboard draws them:
    each with its offset and duration from the request's first span in milliseconds and its depth
    below its parent, in start order; and the time of each kind of hop (spans without children), summed.
    Pure."""
    spans: list[dict[str, Any]] = []
    for item in raw:
        try:
            entry = json.loads(item)
        except ValueError:
            continue
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("start"), float | int)
            and isinstance(entry.get("end"), float | int)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("attributes", {}), dict)
        ):
            spans.append(entry)
    if not spans:
        return {"request_id": request_id, "spans": [], "hops": {}}
    spans.sort(key=lambda s: (s["start"], -s["end"]))
    t0 = spans[0]["start"]
    t1 = max(s["end"] for s in spans)
    by_id = {s.get("span_id"): s for s in spans}
    parents = {s.get("parent_id") for s in spans}
    out = []
    hops: dict[str, float] = {}  # leaf spans only: a span with children is the sum of them and more
    for s in spans:
        depth, parent = 0, by_id.get(s.get("parent_id"))
        while parent is not None and depth < 32:
            depth, parent = depth + 1, by_id.get(parent.get("parent_id"))
        took_ms = (s["end"] - s["start"]) * 1000
        if s.get("span_id") not in parents:
            hops[s["name"]] = round(hops.get(s["name"], 0.0) + took_ms, 3)
        out.append(
            {
                "name": s["name"],
                "service": s.get("service"),
                "offset_ms": round((s["start"] - t0) * 1000, 3),
                "duration_ms": round(took_ms, 3),
                "depth": depth,
                "error": s.get("error"),
                "trace_id": s.get("trace_id"),
                "attributes": s.get("attributes", {}),
            }
        )
    return {
        "request_id": request_id,
        "started_at": t0,
        "total_ms": round((t1 - t0) * 1000, 3),
        "trace_ids": sorted({s["trace_id"] for s in out if s["trace_id"]}),
        "spans": out,
        "hops": hops,
    }


def slowest(members: Sequence[Any], since: float, limit: int) -> list[dict[str, Any]]:
    """The slowest requests that ended since `since`, from the minutes' slow-trace sets (member
    "<request id> <end>", score its duration in seconds). Pure."""
    rows: list[dict[str, Any]] = []
    for member, took in members:
        text = member.decode() if isinstance(member, bytes) else str(member)
        request_id, _, end = text.partition(" ")
        try:
            ended = float(end)
        except ValueError:
            continue
        if ended >= since:
            rows.append({"request_id": request_id, "seconds": float(took), "ended_at": ended})
    rows.sort(key=lambda r: -float(r["seconds"]))
    return rows[:limit]
