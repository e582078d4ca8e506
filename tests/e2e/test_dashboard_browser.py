"""The dashboard in a real browser: Debian's headless chromium driven by playwright.

A real nats-server, the controller and scripted node agents (tests/agent_sim.py) run the cluster;
`ndif deploy` and `ndif evict` run as subprocesses. The page must show the new replica blocks and
their levels within 2 s of each command returning, without a reload; the timeline shows the state
before the eviction; a replica's history opens; the screenshot lands in the test's temp dir, or in
docs/dashboard.png with NDIF_UPDATE_SCREENSHOT=1 (a test run leaves the tree as it was). The page
opens from the URL with the operator token, then shows the clean URL and runs on the cookie, under the
server's Content-Security-Policy with no violation; without the token a browser gets nothing.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controlplane.dashboard import Dashboard
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from dataplane.node.tiny_models import make_tiny_gpt2, make_tiny_llama
from tests.agent_sim import GB, ScriptedAgent
from tests.conftest import fresh_event_log
from tests.integration.cluster import ndif, settle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
LIVE_WITHIN_MS = 2000


async def launch_chromium(p: Any) -> Any:
    """Debian's chromium (playwright's own browser download is not reachable from these machines)."""
    return await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


@pytest_asyncio.fixture
async def browser() -> AsyncIterator[Any]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed and could not be: `apt-get install -y chromium` (.ci/run does it)")
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        b = await launch_chromium(p)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return str(make_tiny_gpt2(root / "tiny-gpt2")), str(make_tiny_llama(root / "tiny-llama"))


async def test_live_timeline_and_history_in_a_browser(nats_server: EmbeddedNats, browser: Any,
                                                     checkpoints: tuple[str, str], tmp_path: Path) -> None:
    gpt2, llama = checkpoints
    url = nats_server.url
    lg = await fresh_event_log(url)
    parts = [Controller.from_url(url, policy_interval_s=0.2),
             ScriptedAgent(url, "node-a", gpus=4, cpu_cache_bytes=200 * GB),
             ScriptedAgent(url, "node-b", gpus=4, cpu_cache_bytes=200 * GB)]
    for part in parts:
        await part.start()
    admin = await AdminClient.open(url, timeout=20)
    try:
        await settle(admin)
        ran = await ndif(url, "deploy", llama, "--replicas", "3", "--size-gib", "50", "--wait")
        assert ran.rc == 0, ran.err
        async with Dashboard.from_url(url, port=0) as dash:
            stranger = await browser.new_page()  # no token: refused, nothing of the cluster shown
            assert (await stranger.goto(dash.base_url)).status == 401
            assert (await stranger.goto(dash.base_url + "api/state")).status == 401
            await stranger.close()

            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            csp: list[str] = []
            page.on("console", lambda m: csp.append(m.text) if "Content Security Policy" in m.text else None)
            await page.goto(dash.url)
            await page.wait_for_function("window.ndif && window.ndif.ready && window.ndif.renderedSeq > 0")
            assert page.url == dash.base_url  # the token left the address bar; the cookie carries it
            assert await page.locator(".node").count() == 2
            assert await page.locator('.card .block[data-level="HOT"]').count() >= 3
            # Widths come through the CSSOM (no inline style under the CSP).
            assert (await page.locator(".card .block").first.evaluate("e => e.style.width")).endswith("%")

            # Deploy through the CLI: the new blocks appear, HOT, within 2 s, without a reload.
            ran = await ndif(url, "deploy", gpt2, "--replicas", "2", "--size-gib", "30", "--wait")
            assert ran.rc == 0, ran.err
            t0 = time.monotonic()
            for rid in (0, 1):
                await page.wait_for_selector(f'.card .block[data-model*="tiny-gpt2"][data-replica="{rid}"]'
                                             '[data-level="HOT"]', timeout=LIVE_WITHIN_MS)
            assert time.monotonic() - t0 < LIVE_WITHIN_MS / 1000
            before_evict = (await admin.state()).seq

            # Evict through the CLI: replica 0 leaves its card and shows WARM in the node's CPU cache.
            ran = await ndif(url, "evict", gpt2, "--replica-id", "0")
            assert ran.rc == 0, ran.err
            gpt2_block = '[data-model*="tiny-gpt2"][data-replica="0"]'
            await page.wait_for_selector(f'.cpu .block{gpt2_block}[data-level="WARM"]', timeout=LIVE_WITHIN_MS)
            await page.wait_for_selector(f'.card .block{gpt2_block}', state="detached", timeout=LIVE_WITHIN_MS)
            assert await page.evaluate("window.ndif.mode") == "live"

            # The timeline, back to before the eviction: replica 0 is HOT on its card again.
            await page.locator("#slider").fill(str(before_evict))
            await page.wait_for_selector(f'.card .block{gpt2_block}[data-level="HOT"]', timeout=5000)
            assert await page.locator(f".cpu .block{gpt2_block}").count() == 0
            assert (await page.text_content("#mode")) == f"AT SEQ {before_evict}"
            assert await page.evaluate("window.ndif.renderedSeq") == before_evict
            # ...and back to live.
            await page.click("#live")
            await page.wait_for_selector(f'.cpu .block{gpt2_block}[data-level="WARM"]', timeout=5000)
            assert (await page.text_content("#mode")) == "LIVE"

            # A replica's history: every step with its command and actor, and the state it left.
            await page.click(f".cpu .block{gpt2_block}")
            await page.wait_for_selector("#drill:not([hidden]) #history tbody tr")
            rows = await page.locator("#history tbody tr").all_inner_texts()
            text = "\n".join(rows)
            assert "ReplicaScheduled" in rows[0] and "LoadRequested" in rows[0] and "cli:" in rows[0]
            assert "ReplicaEvictionRequested" in text and rows[-1].split("\t")[5] == "Cached", rows
            await page.click("#drill-close")
            await page.wait_for_timeout(300)
            shot = DOCS_SCREENSHOT if os.environ.get("NDIF_UPDATE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000  # a page was drawn
            assert csp == [], csp
            await page.close()
    finally:
        await admin.close()
        for part in reversed(parts):
            await part.stop()
        await lg.close()
