"""A browser's EventSource on a chat stream survives the ingress it is connected to.

The end-to-end stack's two ingresses behind a failover proxy (what a load balancer does: a new
connection goes to the first ingress that answers). A page in headless Chromium starts a streamed chat
with fetch, takes the stream's URL from the response header, and reads it with an EventSource. Once text
shows, the ingress carrying the EventSource is killed: the browser reconnects by itself with
Last-Event-ID, the proxy sends it to the other ingress, and the page's text completes, each event once.
The killed ingress is started again for the tests after. Screenshot under test-artifacts/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from infra.devstack import DevStack, Endpoints
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)

ARTIFACTS = Path(os.environ.get("SLUICE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
BODY = {"model": "sluice-slow", "stream": True, "max_tokens": 150,
        "messages": [{"role": "user", "content": "tell me a long story"}]}  # fmt: skip

PAGE = """<!doctype html><html><body><p id="status"></p><pre id="text"></pre><script>
"use strict";
const api = %(api)s, key = %(key)s, body = %(body)s;
const ids = [];
let text = "";
async function run() {
  const reply = await fetch(api + "/v1/chat/completions", {
    method: "POST", body: JSON.stringify(body),
    headers: {"authorization": "Bearer " + key, "content-type": "application/json"},
  });
  const path = reply.headers.get("x-sluice-stream");
  await reply.body.cancel();  // leave this connection: the stream is read with an EventSource
  const source = new EventSource(api + path);
  let opens = 0;
  const status = () => {
    document.getElementById("status").textContent =
      `EventSource: connected ${opens} time(s), ${ids.length} events, last id ${ids[ids.length - 1]}`;
  };
  source.onopen = () => { opens += 1; document.body.dataset.opens = String(opens); status(); };
  source.onmessage = (event) => {
    ids.push(Number(event.lastEventId));
    document.body.dataset.ids = JSON.stringify(ids);
    status();
    if (event.data === "[DONE]") { source.close(); document.body.dataset.done = "1"; return; }
    for (const choice of JSON.parse(event.data).choices || []) text += (choice.delta || {}).content || "";
    document.getElementById("text").textContent = text;
  };
}
run().catch((err) => { document.body.dataset.error = String(err); });
</script></body></html>
"""


class FailoverProxy:
    """TCP on loopback: each new connection goes to the first backend port that accepts it."""

    def __init__(self, backends: list[int]) -> None:
        self.backends = backends
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for port in self.backends:
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                continue
        else:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def __enter__(self) -> FailoverProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_an_event_source_completes_through_the_other_ingress(
    dev_stack: tuple[DevStack, Endpoints], browser: webdriver.Chrome, tmp_path: Path
) -> None:
    dev, endpoints = dev_stack
    ports = [int(url.rsplit(":", 1)[1]) for url in dev.ingress_urls]
    site = tmp_path / "site"
    site.mkdir()
    with FailoverProxy(ports) as proxy:
        api = f"http://127.0.0.1:{proxy.port}"
        page = PAGE % {"api": json.dumps(api), "key": json.dumps(endpoints.api_key), "body": json.dumps(BODY)}
        (site / "index.html").write_text(page)
        handler = partial(SimpleHTTPRequestHandler, directory=str(site))
        with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            browser.get(f"http://127.0.0.1:{server.server_address[1]}/index.html")

            def shown() -> str:
                body = browser.find_element(By.TAG_NAME, "body")
                assert not body.get_attribute("data-error"), body.get_attribute("data-error")
                return str(browser.find_element(By.ID, "text").text)

            until(lambda: len(shown()) > 20, 30, "text from the first ingress")
            before = shown()
            dev.halt("ingress")  # the first ingress, which carries the EventSource
            try:
                until(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1", 60,
                      "the page's text completed through the other ingress")  # fmt: skip
            finally:  # the stack is shared with the other end-to-end tests: its first ingress comes back
                dev.resume("ingress")
                until(lambda: healthy(dev.ingress_urls[0]), 120, "the first ingress back")
            text = shown()
            body = browser.find_element(By.TAG_NAME, "body")
            ids = json.loads(str(body.get_attribute("data-ids")))
            opens = int(str(body.get_attribute("data-opens")))
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(str(ARTIFACTS / "event-source-resumed.png"))
            server.shutdown()
    assert opens >= 2, "the EventSource reconnected"
    assert ids == list(range(ids[0], ids[0] + len(ids))), "every event once, in order"
    assert ids[0] == 0
    assert text.startswith(before)
    headers = {"Authorization": f"Bearer {endpoints.api_key}"}
    whole = httpx.post(dev.ingress_urls[1] + "/v1/chat/completions", json={**BODY, "stream": False},
                       headers=headers, timeout=60).json()  # fmt: skip
    assert text == whole["choices"][0]["message"]["content"], "the same text as an uninterrupted run"


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
