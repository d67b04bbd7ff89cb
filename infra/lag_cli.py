"""`sluice lag`: the dashboard's numbers as a live terminal table, read from the scaler's /api/dashboard."""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group, JustifyMethod
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {"OK": "green", "WARN": "yellow"}  # every other status is an alarm


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def replicas_cell(r: dict[str, int]) -> str:
    """Ready/desired, then starting (+) and draining (-) when there are any: `2/4 +1`."""
    cell = f"{r['ready']}/{r['desired']}"
    if r["starting"]:
        cell += f" +{r['starting']}"
    if r["draining"]:
        cell += f" -{r['draining']}"
    return cell


def pool_rows(body: dict[str, Any]) -> list[list[str]]:
    """One row per pool: lag, status, backlog, rates, replicas and speculative decoding."""
    rows = []
    for p in body["pools"]:
        rows.append([
            p["pool"], str(p["lag"]), p["status"], str(p["backlog"]), _num(p["batch_lag"]),
            _num(p["arrival_rate"], 2), _num(p["completion_rate"], 2), replicas_cell(p["replicas"]),
            "on" if p["spec_decoding"] else "off",
        ])  # fmt: skip
    return rows


def decision_lines(body: dict[str, Any]) -> list[str]:
    """Each pool's last scaling decision, a line of its own under the table."""
    return [f"{p['pool']}: {p['decision']['action']}, {p['decision']['reason']}" for p in body["pools"]]


def worker_rows(body: dict[str, Any]) -> list[list[str]]:
    """One row per worker of every pool: KV use, running and waiting, prefix-cache hits."""
    rows = []
    for p in body["pools"]:
        for w in p["workers"]:
            rows.append([
                p["pool"], w["worker"], w["state"], _pct(w["kv_used"]), str(w["running"]),
                str(w["waiting"]), _pct(w["prefix_hit"]), _num(w["decode_tokens_per_s"]),
                f"{w['heartbeat_age_s']:.1f}s",
            ])  # fmt: skip
    return rows


# Short headers: with a narrow terminal the numbers keep their columns, and only names are cut short.
POOL_COLUMNS = ["pool", "lag", "status", "backlog", "batch", "in/s", "done/s", "replicas", "spec"]
WORKER_COLUMNS = ["pool", "worker", "state", "KV", "run", "wait", "hits", "tok/s", "age"]
NAMES = 2  # the leading columns that hold names: they shrink (cut with …) before any number does


def table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    """Number and state columns keep their full width; the name columns get what is left, cut with …"""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, name in enumerate(columns):
        if i < NAMES:
            t.add_column(name, overflow="ellipsis", no_wrap=True, max_width=20)
        else:
            widest = max([len(name), *(len(row[i]) for row in rows)])
            justify: JustifyMethod = "left" if name in ("status", "state", "spec") else "right"
            t.add_column(name, justify=justify, no_wrap=True, min_width=widest)
    return t


def render(body: dict[str, Any]) -> Group:
    rows = pool_rows(body)
    pools = table("pools", POOL_COLUMNS, rows)
    for row in rows:
        style = STATUS_STYLE.get(row[2], "bold red")
        pools.add_row(*row[:2], Text(row[2], style=style), *row[3:])
    decisions = [Text(line, style="dim") for line in decision_lines(body)]
    rows = worker_rows(body)
    workers = table("workers", WORKER_COLUMNS, rows)
    for row in rows:
        workers.add_row(*row)
    stamp = Text(f"read at {time.strftime('%H:%M:%S', time.localtime(body['now']))}", style="dim")
    if not body["pools"]:
        stamp = Text("the scaler has not read any pool yet", style="dim")
    return Group(pools, *decisions, workers, stamp)


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
