"""`sluice lag`: the dashboard's numbers as a live terminal table, read from the scaler's /api/dashboard."""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {"OK": "green", "WARN": "yellow"}  # every other status is an alarm


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def pool_rows(body: dict[str, Any]) -> list[list[str]]:
    """One row per pool: lag, status, backlog, rates, replicas and the last decision."""
    rows = []
    for p in body["pools"]:
        r = p["replicas"]
        rows.append([
            p["pool"], str(p["lag"]), p["status"], str(p["backlog"]), _num(p["batch_lag"]),
            _num(p["arrival_rate"], 2), _num(p["completion_rate"], 2),
            f"{r['ready']}/{r['desired']}", str(r["starting"]), str(r["draining"]),
            "on" if p["spec_decoding"] else "off", f"{p['decision']['action']}: {p['decision']['reason']}",
        ])  # fmt: skip
    return rows


def worker_rows(body: dict[str, Any]) -> list[list[str]]:
    """One row per worker of every pool: KV use, running and waiting, prefix-cache hits."""
    rows = []
    for p in body["pools"]:
        for w in p["workers"]:
            rows.append([
                p["pool"], w["worker"], w["state"], _pct(w["kv_used"]), str(w["running"]),
                str(w["waiting"]), _pct(w["prefix_hit"]), _num(w["decode_tokens_per_s"]),
                f"{w['heartbeat_age_s']:.1f} s",
            ])  # fmt: skip
    return rows


POOL_COLUMNS = [
    "pool", "lag", "status", "backlog", "batch lag", "arrivals/s", "done/s", "ready/desired", "starting",
    "draining", "spec", "last decision",
]  # fmt: skip
WORKER_COLUMNS = ["pool", "worker", "state", "KV used", "running", "waiting", "prefix hits", "tok/s", "age"]


def render(body: dict[str, Any]) -> Group:
    pools = Table(*POOL_COLUMNS, title="pools", title_justify="left")
    for row in pool_rows(body):
        style = STATUS_STYLE.get(row[2], "bold red")
        pools.add_row(*row[:2], Text(row[2], style=style), *row[3:])
    workers = Table(*WORKER_COLUMNS, title="workers", title_justify="left")
    for row in worker_rows(body):
        workers.add_row(*row)
    stamp = Text(f"read at {time.strftime('%H:%M:%S', time.localtime(body['now']))}", style="dim")
    if not body["pools"]:
        stamp = Text("the scaler has not read any pool yet", style="dim")
    return Group(pools, workers, stamp)


def fetch(url: str, client: httpx.Client) -> dict[str, Any]:
    response = client.get(url.rstrip("/") + "/api/dashboard", timeout=5)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def watch(url: str, interval_s: float, once: bool) -> None:
    """Print the tables once, or redraw them every `interval_s` until interrupted (in a terminal; piped
    output gets one full print per interval instead)."""
    console = Console()
    with httpx.Client() as client:
        if once or not console.is_terminal:
            while True:
                console.print(render(fetch(url, client)))
                if once:
                    return
                time.sleep(interval_s)
        with Live(render(fetch(url, client)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                try:
                    live.update(render(fetch(url, client)), refresh=True)
                except httpx.HTTPError as exc:
                    live.update(Text(f"the scaler at {url} does not answer: {exc}", style="bold red"))
                    live.refresh()
