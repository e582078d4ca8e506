"""The dashboard in a real browser: Debian's headless chromium driven by playwright.

One cluster for the module: a real nats-server, the controller, scripted node agents
(tests/agent_sim.py) and a real dispatcher whose replica calls go to the agents' in-memory
processes (tests/fake_runtime.py FakeCaller); `ndif deploy`, `evict` and `scale` run as
subprocesses. The tests run in order on it (each reads what it did itself, never a count left by
another). The page opens from the URL with the operator token, then shows the clean URL and runs on
the cookie (without the token a browser gets nothing), under the server's own Content-Security-Policy
(no inline script or style); a violation fails the test. Each test's screenshot lands in the test's temp dir, or in
docs/dashboard*.png with NDIF_UPDATE_SCREENSHOT=1 (a test run leaves the tree as it was).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controlplane.dashboard import Dashboard
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client
from dataplane.serving.dispatcher import Dispatcher
from schemas import events as E
from schemas.keys import canonical_model_key
from tests.agent_sim import GB, ScriptedAgent
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log
from tests.fake_runtime import FakeCaller
from tests.integration.cluster import ndif, settle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS = Path(__file__).resolve().parents[2] / "docs"
LIVE_WITHIN_MS = 2000
BROKEN_ERROR = "sim: config.json is corrupt"  # what tests/fake_runtime.py's failing load says


async def until(page: Any, js: str, timeout: float = 10.0) -> Any:
    """Poll a JS expression until it is truthy (page.evaluate runs outside the page's CSP, where
    playwright's own wait_for_function would need eval)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await page.evaluate(js)
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout} s: {js}")
        await asyncio.sleep(0.1)


async def launch_chromium(p: Any) -> Any:
    """Debian's chromium (playwright's own browser download is not reachable from these machines)."""
    return await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


@dataclass
class Scene:
    url: str
    admin: AdminClient
    log: JetStreamEventLog
    dash: Dashboard
    browser: Any
    ckpt: dict[str, str]
    shots: Path
    violations: list[str] = field(default_factory=list)

    def key(self, name: str) -> str:
        return canonical_model_key(self.ckpt[name])

    def sel(self, name: str) -> str:
        """An attribute selector for a model's elements (its key has quotes: match the checkpoint dir)."""
        return f'[data-model*="tiny-{name}"]'

    async def page(self, width: int = 1400, height: int = 900) -> Any:
        """A page on the dashboard (opened with the operator token), CSP violations recorded."""
        page = await self.browser.new_page(viewport={"width": width, "height": height})
        page.on("console", lambda m: self.violations.append(m.text)
                if m.type == "error" and "Content Security Policy" in m.text else None)
        await page.goto(self.dash.url)
        await until(page, "window.ndif && window.ndif.ready && window.ndif.renderedSeq > 0")
        return page

    async def shot(self, page: Any, name: str, *, full: bool = False) -> None:
        target = DOCS / name if os.environ.get("NDIF_UPDATE_SCREENSHOT") == "1" else self.shots / name
        if full:
            await page.evaluate("window.scrollTo(0, 0)")
            await page.wait_for_timeout(200)
        await page.screenshot(path=str(target), full_page=full)
        assert target.stat().st_size > 10_000  # a page was drawn
        assert not self.violations, self.violations


@pytest.fixture(scope="module")
def checkpoints(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"gpt2": str(tiny_models.gpt2(root / "tiny-gpt2")), "neo": str(tiny_models.gpt2(root / "tiny-neo")),
            "broken": str(tiny_models.gpt2(root / "tiny-broken")), "llama": str(tiny_models.llama(root / "tiny-llama"))}


@pytest_asyncio.fixture(scope="module")
async def scene(nats_server: EmbeddedNats, checkpoints: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scene]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed and could not be: `apt-get install -y chromium` (.ci/run does it)")
    from playwright.async_api import async_playwright

    url = nats_server.url
    lg = await fresh_event_log(url)
    broken = lambda mk: "tiny-broken" in mk  # noqa: E731 - every node fails to load that one
    agents = [ScriptedAgent(url, "node-a", gpus=4, cpu_cache_bytes=200 * GB, fail_loads=broken),
              ScriptedAgent(url, "node-b", gpus=4, cpu_cache_bytes=200 * GB, fail_loads=broken)]
    ctl = Controller.from_url(url, policy_interval_s=0.2)
    disp = Dispatcher.from_url(url, caller=FakeCaller([a.runtime for a in agents], run_s=0.03))
    disp.use_link = False  # the fake processes have no NATS endpoint: calls go through the caller
    parts: list[Any] = [ctl, *agents]
    for part in parts:
        await part.start()
    admin = await AdminClient.open(url, timeout=20)
    try:
        await settle(admin)
        for name, n, size in (("llama", 3, 50), ("gpt2", 2, 20)):
            ran = await ndif(url, "deploy", checkpoints[name], "--replicas", str(n), "--size-gib", str(size),
                             "--wait")
            assert ran.rc == 0, ran.err
        await disp.start()
        parts.append(disp)
        async with Dashboard.from_url(url, port=0, queue_poll_s=0.5) as dash, async_playwright() as p:
            browser = await launch_chromium(p)
            try:
                yield Scene(url, admin, lg, dash, browser, checkpoints, tmp_path_factory.mktemp("shots"))
            finally:
                await browser.close()
    finally:
        await admin.close()
        for part in reversed(parts):
            await part.stop()
        await lg.close()


async def test_live_timeline_and_history_in_a_browser(scene: Scene) -> None:
    url = scene.url
    stranger = await scene.browser.new_page()  # no token: refused, nothing of the cluster shown
    assert (await stranger.goto(scene.dash.base_url)).status == 401
    assert (await stranger.goto(scene.dash.base_url + "api/state")).status == 401
    await stranger.close()
    page = await scene.page()
    assert page.url == scene.dash.base_url  # the token left the address bar; the cookie carries it
    # Widths come through the CSSOM (no inline style under the CSP).
    assert (await page.locator(".card .block").first.evaluate("e => e.style.width")).endswith("%")
    assert await page.locator(".node").count() == 2
    assert await page.locator('.card .block[data-level="HOT"]').count() >= 5

    # Deploy through the CLI: the new blocks appear, HOT, within 2 s, without a reload.
    ran = await ndif(url, "deploy", scene.ckpt["neo"], "--replicas", "2", "--size-gib", "30", "--wait")
    assert ran.rc == 0, ran.err
    t0 = time.monotonic()
    for rid in (0, 1):
        await page.wait_for_selector(f'.card .block[data-model*="tiny-neo"][data-replica="{rid}"][data-level="HOT"]',
                                     timeout=LIVE_WITHIN_MS)
    assert time.monotonic() - t0 < LIVE_WITHIN_MS / 1000
    before_evict = (await scene.admin.state()).seq

    # Evict through the CLI: replica 0 leaves its card and shows WARM in the node's CPU cache, its
    # chip naming its model.
    ran = await ndif(url, "evict", scene.ckpt["neo"], "--replica-id", "0")
    assert ran.rc == 0, ran.err
    neo0 = '[data-model*="tiny-neo"][data-replica="0"]'
    await page.wait_for_selector(f'.cpu .block{neo0}[data-level="WARM"]', timeout=LIVE_WITHIN_MS)
    await page.wait_for_selector(f".card .block{neo0}", state="detached", timeout=LIVE_WITHIN_MS)
    assert (await page.text_content(f".cpu .block{neo0}")) == "tiny-neo#0"
    assert await page.evaluate("window.ndif.mode") == "live"

    # The timeline, back to before the eviction: replica 0 is HOT on its card again.
    await page.locator("#slider").fill(str(before_evict))
    await page.wait_for_selector(f'.card .block{neo0}[data-level="HOT"]', timeout=5000)
    assert await page.locator(f".cpu .block{neo0}").count() == 0
    assert (await page.text_content("#mode")) == f"AT SEQ {before_evict}"
    assert await page.evaluate("window.ndif.renderedSeq") == before_evict
    # ...and back to live.
    await page.click("#live")
    await page.wait_for_selector(f'.cpu .block{neo0}[data-level="WARM"]', timeout=5000)
    assert (await page.text_content("#mode")) == "LIVE"

    # A replica's history: every step with its node, cards, command and actor, and the state it left.
    await page.click(f".cpu .block{neo0}")
    await page.wait_for_selector("#drill:not([hidden]) #history tbody tr")
    rows = [r.split("\t") for r in await page.locator("#history tbody tr").all_inner_texts()]
    assert rows[0][2] == "ReplicaScheduled" and rows[0][7] == "LoadRequested" and rows[0][5].startswith("cli:"), rows
    assert rows[0][3] in ("node-a", "node-b") and rows[0][4].startswith("gpu "), rows
    assert len(rows[0][1]) == len("2026-01-01 00:00:00.000Z") and rows[0][1].endswith("Z"), rows[0][1]
    assert any(r[2] == "ReplicaEvictionRequested" for r in rows) and rows[-1][7] == "Cached", rows
    await page.click("#drill-close")
    await page.wait_for_timeout(300)
    await scene.shot(page, "dashboard.png", full=True)
    await page.close()


async def test_a_failed_load_is_red_with_its_error(scene: Scene) -> None:
    page = await scene.page()
    ran = await ndif(scene.url, "deploy", scene.ckpt["broken"], "--replicas", "1", "--size-gib", "10")
    assert ran.rc in (0, 7), ran.err  # the command is recorded; the load fails on the node
    m = scene.sel("broken")
    row = page.locator(f"#failures tbody tr.failed{m}").first
    await row.wait_for(timeout=10_000)
    text = await row.inner_text()
    assert "LoadFailed" in text and BROKEN_ERROR in text, text
    # One in-page read (the table is redrawn as events arrive: a cell resolved in one call and
    # read in the next can be detached by then, and a detached cell has no computed colour).
    cell = f"document.querySelector('#failures tbody tr.failed{m} td.bad')"
    colour = f"(() => {{ const c = {cell}; return c && c.isConnected ? getComputedStyle(c).color : ''; }})()"
    red = await until(page, f"{colour} || null", timeout=5)
    assert red == "rgb(201, 42, 42)", red
    assert int(await page.text_content("#failure-count")) >= 1
    assert "bad" in (await page.get_attribute("#failures-btn", "class") or "")
    # The model's status is coloured by health, and its own replica list shows the failed one.
    status = page.locator(f"#models tr{m} .status")
    await until(page, f"document.querySelector('#models tr{m} .status')?.textContent === 'Failed'",
                                 timeout=15)
    assert "bad" in (await status.get_attribute("class") or "")
    await page.click(f"#models tr{m}")
    rep = page.locator(f"#replicas tbody tr{m}").first
    await rep.wait_for()
    assert BROKEN_ERROR in await rep.inner_text()
    # Its ReplicaLoadFailed row in the events table carries the error text.
    ev = page.locator("#events tbody tr.failed", has_text="ReplicaLoadFailed").first
    await ev.wait_for(timeout=5000)
    assert BROKEN_ERROR in await ev.inner_text()
    await page.evaluate("window.scrollTo(0, 0)")
    await scene.shot(page, "dashboard-failures.png")
    # A failed replica is clickable: its history, error included.
    await row.click()
    await page.wait_for_selector("#drill:not([hidden]) #history tbody tr")
    assert BROKEN_ERROR in await page.inner_text("#history")
    await page.close()


async def test_the_anomaly_count_is_shown_with_the_list_behind_it(scene: Scene) -> None:
    page = await scene.page()
    count = int(await page.text_content("#anomaly-count"))
    # What a damaged store looks like: a fact about a replica that was never scheduled, stored in the
    # log itself (as a store from before the fact gate may hold; the gate refuses such a fact now).
    ghost = E.ReplicaLoaded(event_id="ghost-1", ts=datetime.now(UTC),
                            actor="agent:node-a", model_key=scene.key("gpt2"), replica_id=77, node_id="node-a")
    await scene.log.js.publish(E.event_subject(ghost), E.encode_event(ghost), headers=E.event_headers(ghost))
    await until(page, f"+document.getElementById('anomaly-count').textContent === {count + 1}",
                                 timeout=LIVE_WITHIN_MS * 2 / 1000)
    assert "bad" in (await page.get_attribute("#anomalies-btn", "class") or "")
    await page.click("#anomalies-btn")
    await page.wait_for_selector("#anomalies-panel:not([hidden]) #anomalies tbody tr")
    first = await page.locator("#anomalies tbody tr").first.inner_text()
    assert "ReplicaLoaded" in first and "77" in first, first
    await scene.shot(page, "dashboard-anomalies.png")
    await page.close()


async def test_a_plot_moves_while_requests_flow(scene: Scene) -> None:
    page = await scene.page()
    mk = scene.key("gpt2")
    await page.select_option("#window", "300")
    await page.click(f"#models tr{scene.sel('gpt2')}")
    await until(page, f"window.ndif.plots.model === {mk!r} && window.ndif.plots.queue")
    t1_before = await page.evaluate("window.ndif.plots.t1")
    pixels_before = await page.evaluate("document.querySelector('#plot-rate canvas').toDataURL()")

    stop = asyncio.Event()

    async def flow() -> int:
        n = 0
        async with Client(scene.url) as c:
            while not stop.is_set():
                jobs = [await c.submit(scene.ckpt["gpt2"], {"op": "echo", "data": n + i}) for i in range(20)]
                for j in jobs:
                    await j.result(timeout=30)
                    await j.close()
                n += len(jobs)
                await asyncio.sleep(0.05)
        return n

    task = asyncio.create_task(flow())
    try:
        await until(page, 
            "(window.ndif.plots.queue.completed_per_s || []).some(v => v > 0) && "
            "(window.ndif.plots.queue.p50_s || []).some(v => v > 0)", timeout=20)
        await asyncio.sleep(4)  # a few more slices of flow: what the screenshot shows
    finally:
        stop.set()
        sent = await task
    assert sent > 0
    assert await page.evaluate("window.ndif.plots.t1") > t1_before  # the window moved on
    pixels_after = await page.evaluate("document.querySelector('#plot-rate canvas').toDataURL()")
    assert pixels_after != pixels_before
    caption = await page.inner_text("#plots figure:nth-child(2) figcaption")
    assert "sampled by this dashboard" in caption, caption
    await page.locator("#plots").scroll_into_view_if_needed()
    await scene.shot(page, "dashboard-plots.png")
    await page.close()


async def test_the_lifeline_of_a_replica_evicted_and_brought_back(scene: Scene) -> None:
    mk = scene.key("gpt2")
    ran = await ndif(scene.url, "evict", scene.ckpt["gpt2"], "--replica-id", "0")
    assert ran.rc == 0, ran.err
    await settle(scene.admin)
    ran = await ndif(scene.url, "scale", scene.ckpt["gpt2"], "--replicas", "2", "--wait")
    assert ran.rc == 0, ran.err
    await settle(scene.admin)
    page = await scene.page()
    await page.click(f"#models tr{scene.sel('gpt2')}")
    fn = (f"(window.ndif.lifeline.replicas.find(r => r.model_key === {mk!r} && r.replica_id === 0) || "
          "{phases: []}).phases.join(' ')")
    await until(page, f"/HOT.*WARM.*HOT/.test({fn})", timeout=10)
    phases = (await page.evaluate(fn)).split()
    assert phases[-1] == "HOT" and "WARM" in phases, phases
    # The decision that moved it, on hover.
    line = page.locator(f"#lifeline g{scene.sel('gpt2')}[data-replica=\"0\"]")
    await line.locator('rect[data-phase="WARM"]').first.hover()
    tip = await page.inner_text("#tip")
    # The WARM segment began with the agent's ReplicaCached; the decision behind it is the evict.
    assert "WARM" in tip and "ReplicaCached" in tip and "decision:" in tip and "ReplicaEvictionRequested" in tip, tip
    assert "(evict, command" in tip and "admin -> WARM" in tip, tip
    moved = line.locator("rect:not([data-phase='WARM'])")
    texts = []
    for i in range(await moved.count()):
        await moved.nth(i).hover()
        texts.append(await page.inner_text("#tip"))
    assert any("ReplicaEvictionRequested" in t and "evict" in t for t in texts), texts
    assert any("source" in t or "from WARM" in t or "ReplicaScheduled" in t for t in texts), texts
    await line.locator('rect[data-phase="WARM"]').first.hover()
    await page.locator("#lifeline").scroll_into_view_if_needed()
    await scene.shot(page, "dashboard-lifeline.png")
    await page.close()


async def test_the_timeline_at_a_past_seq_is_one_time(scene: Scene) -> None:
    page = await scene.page()
    st = await scene.admin.state()
    seq = st.seq // 2
    assert scene.dash.past is not None
    rows, _ = await scene.dash.past.events(before=seq + 1, limit=1)
    want_time = rows[0]["ts"]
    await page.fill("#seqbox", str(seq))
    await page.click("#go")
    await until(page, f"window.ndif.mode === 'past' && window.ndif.renderedSeq === {seq}")
    # The header: the seq and its wall time.
    assert (await page.text_content("#mode")) == f"AT SEQ {seq}"
    shown = await page.text_content("#seqtime")
    assert shown and shown.replace(" ", "T").rstrip("Z") == want_time.replace("+00:00", "")[:23], (shown, want_time)
    # No live figure unmarked: each queue cell is either sampled-then or marked live only.
    cells = await page.evaluate("[...document.querySelectorAll('[data-live]')].map(c => c.className + '|' + c.title)")
    assert cells and all(("sampled" in c and "sampled by this dashboard" in c) or "liveonly" in c for c in cells), cells
    # The events table scrolled to the seq, highlighted and in view.
    await until(page, f"window.ndif.eventsAt === {seq}")
    at = page.locator("#events tbody tr.at")
    assert await at.count() == 1 and (await at.get_attribute("data-seq")) == str(seq)
    box = await page.locator("#events-scroll").bounding_box()
    row = await at.bounding_box()
    assert box and row and box["y"] <= row["y"] and row["y"] + row["height"] <= box["y"] + box["height"]
    # The plots end at that moment.
    await until(page, "window.ndif.plots.live === false")
    t1 = await page.evaluate("window.ndif.plots.t1")
    assert abs(t1 - scene.dash.model.time_of(seq)) < 1e-3
    await page.locator("#events-section").scroll_into_view_if_needed()
    await scene.shot(page, "dashboard-timeline.png")
    await page.close()


async def test_the_layout_at_1280_px_cuts_nothing(scene: Scene) -> None:
    page = await scene.page(width=1280, height=900)
    await page.wait_for_selector("#failures tbody tr.failed")
    await page.wait_for_selector("#events tbody tr td:nth-child(2)")  # its rows come with a read of their own
    # No horizontal scroll, and no cell, header or card label narrower than its content.
    assert await page.evaluate("document.documentElement.scrollWidth") <= 1280
    cut = await page.evaluate("""() => [...document.querySelectorAll(
        '#models th, #models td, #failures th, #failures td, #replicas th, #replicas td, #events th, #events td, .clabel, header *')]
        .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
        .map(e => e.tagName + ':' + e.textContent.slice(0, 60))""")
    assert cut == [], cut
    # Full times in the events table.
    times = await page.locator("#events tbody tr td:nth-child(2)").all_inner_texts()
    assert times and all(len(t) == len("2026-01-01 00:00:00.000Z") for t in times if t), times[:3]
    # The card labels say used/total, the model filter takes the short name the CLI takes.
    label = (await page.locator(".card .clabel").first.text_content() or "").strip()
    assert label.startswith("gpu0 ") and "/" in label and label.endswith("GiB"), label
    await page.fill("#f-model", "tiny-gpt2")
    await page.click("#f-apply")
    await until(page, "document.querySelectorAll('#events tbody tr').length > 0")
    assert (await page.text_content("#f-error")) == ""
    models = await page.locator("#events tbody td:nth-child(4)").all_inner_texts()
    assert models and all(m.endswith("tiny-gpt2") for m in models), models[:5]
    # The history drawer fits too.
    await page.click("#failures tbody tr.failed")
    await page.wait_for_selector("#drill:not([hidden]) #history tbody tr")
    cut = await page.evaluate("""() => [...document.querySelectorAll('#history th, #history td')]
        .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.slice(0, 60))""")
    assert cut == [], cut
    await page.click("#drill-close")
    await scene.shot(page, "dashboard-1280.png", full=True)
    await page.close()


@pytest.mark.parametrize("width", [1280, 1920])
async def test_an_outage_is_drawn_as_cluster_down_not_as_the_state_before_it(scene: Scene, width: int) -> None:
    """A `ClusterDown` in the log (a controller started after a gap): the lifelines show every replica
    `down` through it, and each plot a band that says "cluster down"."""
    if not [e async for _, e in scene.log.read(1) if isinstance(e, E.ClusterDown)]:
        # dated after the replicas loaded (run alone, this test may come right after their deploy)
        loaded = max([e.ts async for _, e in scene.log.read(1) if isinstance(e, E.ReplicaLoaded)],
                     default=datetime.now(UTC) - timedelta(seconds=10))
        await asyncio.sleep(max(0.0, (loaded + timedelta(seconds=7) - datetime.now(UTC)).total_seconds()))
        now = datetime.now(UTC)
        down = E.ClusterDown(event_id="outage-e2e", ts=now, actor="controller:e2e", command_id="outage-e2e",
                             down_from=max(now - timedelta(seconds=8), loaded + timedelta(seconds=1)),
                             up_at=now - timedelta(seconds=2))
        await scene.log.append([down], None)
        await settle(scene.admin)
    page = await scene.page(width=width, height=900)
    await page.click(f"#models tr{scene.sel('llama')}")
    await until(page, "window.ndif.lifeline.outages && window.ndif.lifeline.outages.length > 0", timeout=10)
    phases = await page.evaluate("window.ndif.lifeline.replicas.map(r => r.phases.join(' '))")
    assert phases and all("down" in p for p in phases), phases
    assert all(p.split().index("down") < len(p.split()) - 1 for p in phases), phases  # back after it
    await until(page, "window.ndif.plots.outages && window.ndif.plots.outages.length > 0", timeout=10)
    assert await page.locator("#lifeline .down-label").count() >= 1
    touching = await page.evaluate("""() => {  // the caption has a line of its own: it meets no time label
        const box = (q) => [...document.querySelectorAll(q)].map((e) => e.getBoundingClientRect());
        const ticks = box('#lifeline text.tick:not(.down-label)');
        return box('#lifeline .down-label').some((a) => ticks.some((b) =>
            a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom)); }""")
    assert not touching
    seg = page.locator('#lifeline rect[data-phase="down"]').first
    await seg.hover()
    assert "cluster down" in await page.inner_text("#tip")
    # The band is drawn on the plot's canvas: grey in the middle of the outage, near the plot's top
    # (above any line), and not where the cluster ran.
    inside, outside = await page.evaluate("""() => { const [a, b] = window.ndif.plots.outages[0];
        return [window.ndif.plotPixel('replicas', (a + b) / 2, 0.05), window.ndif.plotPixel('replicas', a - 2, 0.05)]; }""")
    assert inside[3] > 0 and max(inside[:3]) - min(inside[:3]) < 30 and max(inside[:3]) < 235, inside  # grey, drawn
    assert outside != inside, (inside, outside)
    # No line through it: the replicas plot has a gap there, and its lines go on after it.
    upto, gap, after = await page.evaluate("""() => { const [a, b] = window.ndif.plots.outages[0];
        return [window.ndif.plotValues('replicas', a), window.ndif.plotValues('replicas', (a + b) / 2),
                window.ndif.plotValues('replicas', b + 0.5)]; }""")
    assert upto is None or any(v for v in upto), upto  # the state before it is drawn up to its start
    assert gap and all(v is None for v in gap), gap
    assert after and any(v for v in after), after
    await page.close()


@pytest.mark.parametrize("width", [1280, 1920])
async def test_labels_cards_and_axes_read_as_the_cli_does(scene: Scene, width: int) -> None:
    """Block labels are whole or absent (never a few cut letters), sizes read as `ndif status`'s,
    a failed model is 0 HOT, COLD/WARM replicas hold no card, axes have one format each."""
    page = await scene.page(width=width, height=900)
    await page.wait_for_selector("#nodes .bar .block")
    blocks = await page.evaluate("""() => [...document.querySelectorAll('#nodes .bar .block')].map(b =>
        [b.textContent, b.dataset.label, '#' + b.dataset.replica, b.scrollWidth > b.clientWidth + 1])""")
    assert blocks and all(t in (full, short, "") and not cut for t, full, short, cut in blocks), blocks
    labels = await page.locator(".card .clabel").all_inner_texts()
    import re

    size = r"(\d+\.\d{3}|\d+\.\d|\d+)"  # 3 decimals below 1 GiB, as `ndif status` prints 0.001
    assert labels and all(re.fullmatch(rf"gpu\d+ {size}/{size} GiB", t.strip()) for t in labels), labels
    assert not any(re.search(r"\b0\.00/", t) for t in labels), labels
    broken = await page.locator(f"#models tr{scene.sel('broken')} td:nth-child(3)").inner_text()
    assert broken.strip().startswith("0 /"), broken  # failed: nothing HOT, whatever is wanted
    await page.click(f"#models tr{scene.sel('gpt2')}")
    await page.wait_for_selector(f"#replicas tbody tr{scene.sel('gpt2')}")
    rows = await page.evaluate("""() => [...document.querySelectorAll('#replicas tbody tr')].map(r =>
        [r.cells[2].textContent.trim(), r.cells[5].textContent.trim()])""")
    for level, cards in rows:
        assert cards.startswith("gpu ") if level == "HOT" else cards == ("cpu" if level == "WARM" else "-"), rows
    await until(page, "window.ndif.plotTicks('replicas') && window.ndif.plotTicks('replicas').x.length > 1", timeout=10)
    for name in ("replicas", "latency", "queue"):
        t = await page.evaluate(f"window.ndif.plotTicks({name!r})")
        if t is None:
            continue
        assert all(re.fullmatch(r"\d\d:\d\d:\d\d", x) for x in t["x"]) and len(set(t["x"])) == len(t["x"]), t
        assert len(t["x"]) * 60 <= t["width"], t  # each label has its room: none runs into the next
        decimals = {len(y.split(".")[1]) if "." in y else 0 for y in t["y"] if y}
        assert len(decimals) <= 1, t  # one format on an axis
    await page.close()
