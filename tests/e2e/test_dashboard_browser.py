"""The live dashboard in headless Chromium (Debian's package, driven through its chromedriver).

A dev stack with one slow pool: the page shows lag 0 and one ready replica, a backlog of requests makes
the page's lag rise and the scaler's replica figures move, without reloading. A request picked by id shows
its hops as a timeline. Screenshots are kept under test-artifacts/ (or $SLUICE_TEST_ARTIFACTS).
`sluice lag --once` prints the same pool, within 80 columns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from infra.devstack import DevStack, Endpoints

pytestmark = pytest.mark.timeout(300)

ARTIFACTS = Path(os.environ.get("SLUICE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
REQUESTS = 24

POOLS = """
[[pools]]
name = "slow"
model = "sluice-slow"
max_queued = 1000
[pools.simulated]
ttft_ms = 20
token_ms = 20
max_running = 1
min_words = 10
max_words = 10
[pools.scaling]
min_replicas = 1
max_replicas = 3
startup_s = 5
queue_slo_s = 2
cooldown_s = 600
"""

FAST = {
    "SLUICE_TICK_S": "0.5",
    "SLUICE_HEARTBEAT_INTERVAL_S": "0.2",
    "SLUICE_HOLD_CAPACITY": "2",  # held requests stay in the topic's lag once the hold is full
    "SLUICE_MAX_QUEUE": "1",
    "SLUICE_TRACE_TIMELINE": "1",  # each request's spans kept in Redis for the timeline
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    workdir = tmp_path_factory.mktemp("dashboard-stack")
    config = workdir / "pools.toml"
    config.write_text(POOLS)
    dev = DevStack(workdir, config_path=config, extra_env=FAST)
    try:
        yield dev.start()
    finally:
        dev.stop()


def figure(driver: webdriver.Chrome, pool: str, field: str) -> str:
    selector = f'section[data-pool="{pool}"] [data-field="{field}"]'
    return str(driver.find_element(By.CSS_SELECTOR, selector).text)


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # the page redraws its sections every second; read again
            pass
        time.sleep(0.2)
    raise AssertionError(f"the dashboard did not show {what} within {timeout:.0f} s")


def send_backlog(endpoints: Endpoints, statuses: list[int]) -> None:
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    body = {"model": "sluice-slow", "messages": [{"role": "user", "content": "a backlog"}]}

    def one(_: int) -> int:
        r = httpx.post(endpoints.url + "/v1/chat/completions", json=body, headers=headers, timeout=180)
        return r.status_code

    with ThreadPoolExecutor(REQUESTS) as pool:
        statuses.extend(pool.map(one, range(REQUESTS)))


def test_dashboard_shows_lag_and_replicas_change_under_a_backlog(
    stack: Endpoints, browser: webdriver.Chrome
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.get(stack.scaler_url + "/dashboard")
    wait_for("the pool at rest", lambda: figure(browser, "slow", "ready") == "1", 30)
    assert figure(browser, "slow", "lag") == "0"
    assert figure(browser, "slow", "status") == "OK"
    assert figure(browser, "slow", "batch-lag") == "0"
    assert figure(browser, "slow", "moved") == "0", "no worker was lost"
    assert figure(browser, "slow", "span").startswith("since ")  # the chart's time span
    rows = browser.find_elements(By.CSS_SELECTOR, 'section[data-pool="slow"] tr[data-worker]')
    assert [r.get_attribute("data-worker") for r in rows] == ["slow-w0"]
    updates_before = int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-updates") or 0)
    browser.save_screenshot(str(ARTIFACTS / "dashboard-at-rest.png"))

    statuses: list[int] = []
    sender = threading.Thread(target=send_backlog, args=(stack, statuses))
    sender.start()
    try:
        wait_for("lag above zero", lambda: int(figure(browser, "slow", "lag")) > 0, 30)
        peak_lag = int(figure(browser, "slow", "lag"))
        wait_for(
            "the scaler adding replicas",
            lambda: (
                int(figure(browser, "slow", "desired")) > 1
                and int(figure(browser, "slow", "starting")) + int(figure(browser, "slow", "ready")) > 1
            ),
            60,
        )
        browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        wait_for("a second worker's row", lambda: len(browser.find_elements(
            By.CSS_SELECTOR, 'section[data-pool="slow"] tr[data-worker]')) > 1, 60)  # fmt: skip
    finally:
        sender.join(240)
    updates_after = int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-updates") or 0)
    assert updates_after > updates_before + 5, "the page kept refreshing itself"
    assert peak_lag > 0
    assert statuses == [200] * REQUESTS, "every request of the backlog was served"
    wait_for("the backlog drained", lambda: figure(browser, "slow", "lag") == "0", 60)
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000

    # The terminal view reads the same endpoint.
    sluice = shutil.which("sluice", path=str(Path(sys.executable).parent)) or "sluice"
    for columns in (200, 80):
        out = subprocess.run(
            [sluice, "lag", "--once", "--scaler", stack.scaler_url],
            capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": str(columns)},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "slow" in out.stdout
        assert "slow-w0" in out.stdout
        widest = max(len(line) for line in out.stdout.splitlines())
        assert widest <= columns, f"a line of {widest} characters at {columns} columns:\n{out.stdout}"


# Each hop's span name ends so (the Kafka ones start with their topic).
TIMELINE_HOPS = (
    "admission",
    "publish",
    "receive",
    "placement",
    "inbox",
    "generate",
    "prefill",
    "decode",
    "relay",
)


def shows_every_hop(names: list[str]) -> bool:
    return all(any(name.endswith(hop) for name in names) for hop in TIMELINE_HOPS)


def test_a_request_picked_by_id_shows_its_timeline(stack: Endpoints, browser: webdriver.Chrome) -> None:
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    body = {"model": "sluice-slow", "messages": [{"role": "user", "content": "trace me"}], "stream": True}
    with httpx.stream(
        "POST", stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
    request_id = json.loads(lines[0].removeprefix("data: "))["id"].removeprefix("chatcmpl-")
    timeline = stack.scaler_url + f"/api/traces/{request_id}"

    def recorded() -> bool:  # the root span ends after the hops, so it can come in a later export
        names = [s["name"] for s in httpx.get(timeline).json()["spans"]]
        return shows_every_hop(names) and "POST /v1/chat/completions" in names

    def listed() -> bool:
        recent = httpx.get(stack.scaler_url + "/api/traces", params={"minutes": 10, "limit": 1000}).json()
        return request_id in [r["request_id"] for r in recent["requests"]]

    wait_for("the request's spans recorded", recorded, 30)
    wait_for("the request listed among the recent ones", listed, 10)
    browser.get(stack.scaler_url + "/dashboard")
    wait_for("the slowest requests listed", lambda: bool(browser.find_elements(
        By.CSS_SELECTOR, "#slowest button[data-request]")), 30)  # fmt: skip
    field = browser.find_element(By.ID, "trace-id")
    field.send_keys(f"chatcmpl-{request_id}")
    browser.find_element(By.CSS_SELECTOR, "#trace-form button").click()
    wait_for("the timeline", lambda: browser.find_element(By.TAG_NAME, "body").get_attribute(
        "data-timeline") == request_id, 10)  # fmt: skip
    rows = browser.find_elements(By.CSS_SELECTOR, "#timeline .span-row")
    shown = [str(row.get_attribute("data-span")) for row in rows]
    assert shows_every_hop(shown), shown
    assert shown[0] == "POST /v1/chat/completions", "the request's own span first, the hops under it"

    # Drawn to scale: each hop's bar is its share of the request's time, of the track's width (to a
    # pixel or two of rounding; a bar is at least 2 px wide).
    summary = browser.find_element(By.ID, "trace-summary").text
    total_ms = float(summary.split(": ", 1)[1].split(" ms over ", 1)[0])
    for hop in ("decode", "inbox"):
        (row,) = [r for r in rows if r.get_attribute("data-span") == hop]
        track_px = row.find_element(By.CSS_SELECTOR, ".span-track").size["width"]
        drawn_px = row.find_element(By.CSS_SELECTOR, ".span-bar").size["width"]
        ms = float(row.find_element(By.CSS_SELECTOR, ".span-ms").text.removesuffix(" ms"))
        scaled_px = max(2.0, track_px * ms / total_ms)
        assert abs(drawn_px - scaled_px) <= 2 + 0.01 * track_px, (hop, drawn_px, scaled_px, ms, total_ms)
    assert "where the time went" in browser.find_element(By.ID, "hops").text
    assert "decode" in browser.find_element(By.ID, "hops").text
    browser.save_screenshot(str(ARTIFACTS / "request-timeline.png"))
    assert (ARTIFACTS / "request-timeline.png").stat().st_size > 10_000
    missing = httpx.get(stack.scaler_url + "/api/traces/" + "0" * 32)
    assert missing.status_code == 404
    assert httpx.get(stack.scaler_url + "/api/traces/not%20an%20id").status_code == 400
