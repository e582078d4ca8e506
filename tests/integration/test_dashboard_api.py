"""The dashboard's JSON API against a real nats-server, controller and scripted agent.

Live state, past states, events, history, the update stream, and bad input to every endpoint:
a clear 4xx JSON error, and the server keeps serving. The dashboard appends nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controlplane.dashboard import Dashboard
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas.keys import canonical_model_key
from tests.agent_sim import GB, ScriptedAgent
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log
from tests.integration.cluster import settle

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.gpt2(tmp_path_factory.mktemp("ckpt") / "tiny-gpt2")


@pytest_asyncio.fixture
async def stack(nats_server: EmbeddedNats) -> AsyncIterator[tuple[str, AdminClient, JetStreamEventLog]]:
    lg = await fresh_event_log(nats_server.url)
    url = nats_server.url
    ctl = Controller.from_url(url, policy_interval_s=0.2)
    agent = ScriptedAgent(url, "node-a", gpus=2, cpu_cache_bytes=100 * GB)
    await ctl.start()
    await agent.start()
    admin = await AdminClient.open(url, timeout=20)
    try:
        yield url, admin, lg
    finally:
        await admin.close()
        await agent.stop()
        await ctl.stop()
        await lg.close()


async def get(http: aiohttp.ClientSession, base: str, path: str) -> tuple[int, Any]:
    async with http.get(base + path) as r:
        return r.status, await r.json(content_type=None)


async def test_state_events_history_and_the_stream(stack: Any, tiny: Path) -> None:
    url, admin, lg = stack
    mk = canonical_model_key(str(tiny))
    await settle(admin)
    async with Dashboard.from_url(url, port=0, queue_poll_s=0.2) as d, \
            aiohttp.ClientSession(headers=d.auth_headers()) as http:
        base = d.base_url.rstrip("/")
        status, live = await get(http, base, "/api/state")
        assert status == 200 and [n["node_id"] for n in live["nodes"]] == ["node-a"] and live["live"]
        start_seq = live["seq"]
        async with http.get(f"{base}/api/stream?since={start_seq}") as stream:
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            res = await admin.deploy(str(tiny), 2, size_bytes=30 * GB)
            await admin.wait(res, timeout=20)
            # The pushed updates carry the new replicas' blocks and levels, without asking for the state.
            seen: dict[int, str] = {}
            async with asyncio.timeout(10):
                while set(seen.values()) != {"HOT"} or len(seen) < 2:
                    line = (await stream.content.readline()).decode()
                    if not line.startswith("data: ") or '"events"' not in line:
                        continue
                    u = json.loads(line[6:])
                    for n in u["nodes"]:
                        for c in n["gpus"]:
                            seen.update({b["replica_id"]: b["level"] for b in c["replicas"]})
        loaded_seq = (await admin.state()).seq
        await admin.evict(str(tiny), replica_id=0)
        await settle(admin)
        async with asyncio.timeout(5):
            while d.model.seq < await lg.last_seq():
                await asyncio.sleep(0.02)

        status, now = await get(http, base, "/api/state")
        warm = now["nodes"][0]["warm"]
        assert [(w["model_key"], w["replica_id"]) for w in warm] == [(mk, 0)]
        status, then = await get(http, base, f"/api/state?until={loaded_seq}")
        assert status == 200 and then["seq"] == loaded_seq and not then["live"]
        blocks = {b["replica_id"]: b["level"] for c in then["nodes"][0]["gpus"] for b in c["replicas"]}
        assert blocks == {0: "HOT", 1: "HOT"} and then["nodes"][0]["warm"] == []
        status, at_start = await get(http, base, f"/api/state?until={start_seq}")
        assert at_start["models"] == []

        # A page whose state is older than the stream gets what it missed first (the catch-up).
        async with http.get(f"{base}/api/stream?since={loaded_seq}") as stream:
            async with asyncio.timeout(10):
                while not (line := (await stream.content.readline()).decode()).startswith('data: {"seq"'):
                    pass
            u = json.loads(line[6:])
            assert [e["seq"] for e in u["events"]] == list(range(loaded_seq + 1, d.model.seq + 1))
            assert [(w["model_key"], w["replica_id"]) for w in u["nodes"][0]["warm"]] == [(mk, 0)]
            assert [m["model_key"] for m in u["models"]] == [mk]

        status, ev = await get(http, base, f"/api/events?model={mk}&replica=0&limit=3")
        assert status == 200 and len(ev["events"]) == 3 and ev["next_before"] is not None
        assert all(e["replica_id"] == 0 for e in ev["events"]) and ev["events"][0]["type"] == "ReplicaCached"
        status, older = await get(http, base, f"/api/events?model={mk}&replica=0&before={ev['next_before']}")
        assert older["events"][0]["seq"] < ev["events"][-1]["seq"]
        status, h = await get(http, base, f"/api/history?model={mk}&replica=0")
        steps = [(s["type"], s["state"]) for s in h["steps"]]
        assert steps[0] == ("ReplicaScheduled", "LoadRequested") and steps[-1] == ("ReplicaCached", "Cached")
        assert all(s["actor"] for s in h["steps"]) and h["steps"][0]["command_id"] == res.command_id
        async with asyncio.timeout(5):  # asked every 0.2 s here
            while mk not in (q := (await get(http, base, "/api/queues"))[1])["models"]:
                await asyncio.sleep(0.05)
        assert q["error"].startswith("no dispatcher answered") and q["models"][mk]["pending"] is None


async def test_bad_input_gets_4xx_json_and_the_server_keeps_serving(stack: Any, tiny: Path) -> None:
    url, admin, lg = stack
    await settle(admin)
    before = await lg.last_seq()
    async with Dashboard.from_url(url, port=0) as d, aiohttp.ClientSession(headers=d.auth_headers()) as http:
        base = d.base_url.rstrip("/")
        last = d.model.seq
        cases = {
            "/api/state?until=yesterday": (400, "ISO time"),
            f"/api/state?until={last + 1}": (400, "past the end"),
            "/api/state?until=2026-01-01T00:00:00": (400, "timezone"),
            "/api/state?until=" + "9" * 100: (400, "too long"),
            "/api/state?until=-3": (400, "ISO time"),
            "/api/events?type=Frobnicated": (400, "unknown event type"),
            "/api/events?limit=abc": (400, "integer"),
            "/api/events?limit=100000": (400, "limit"),
            "/api/events?before=0": (400, "before"),
            "/api/events?replica=x": (400, "integer"),
            "/api/events?model=nobody/nothing": (404, "unknown model"),
            "/api/history": (400, "needs ?model"),
            "/api/history?model=nobody/nothing": (404, "unknown model"),
            "/api/history?model=x&replica=-1": (400, "replica"),
            f"/api/stream?since={last + 5}": (400, "past the end"),
            "/api/stream?since=abc": (400, "integer"),
            "/api/nothing-here": (404, "Not Found"),
            "/static/..%2Fserver.py": (404, ""),
            "/static/nothing.js": (404, "no static file"),
        }
        for path, (code, text) in cases.items():
            status, body = await get(http, base, path)
            assert status == code and text in body["error"] and body["status"] == code, (path, status, body)
        async with http.post(base + "/api/state") as r:
            assert r.status == 405 and (await r.json())["status"] == 405
        status, body = await get(http, base, "/api/state")
        assert status == 200 and body["seq"] == last
        async with http.get(base + "/") as r:
            assert r.status == 200 and "ndif dashboard" in await r.text()
        async with http.get(base + "/static/app.js") as r:
            assert r.status == 200 and r.content_type == "text/javascript"
    assert await lg.last_seq() == before  # read-only: nothing appended


async def test_ndif_dashboard_command(nats_server: EmbeddedNats) -> None:
    """`ndif dashboard` prints its URL with the operator token ($NDIF_HOME/auth/dashboard.token), serves
    the page through it (the token then in a cookie), stops on SIGTERM with exit 0; bad flags exit 2."""
    import os
    import signal
    import sys

    lg = await fresh_event_log(nats_server.url)
    await lg.close()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", "dashboard", "--nats", nats_server.url, "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "NDIF_LOG_LEVEL": "WARNING"})
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("ndif dashboard: http://127.0.0.1:") and "read-only" in line, line
        url = line.split()[2]
        base, _, token = url.partition("/?token=")
        assert token == (Path(os.environ["NDIF_HOME"]) / "auth" / "dashboard.token").read_text().strip(), url
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:  # unsafe: an IP host
            assert (await get(http, base, "/api/state"))[0] == 401  # no cookie yet
            async with http.get(url) as r:
                assert r.status == 200 and "ndif dashboard" in await r.text()
            status, body = await get(http, base, "/api/state")  # the cookie the page got
            assert status == 200 and body["live"] and body["seq"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0
    bad = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", "dashboard", "--nats", nats_server.url, "--port", "70000",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(bad.communicate(), 60)
    assert bad.returncode == 2 and b"--port" in err


async def test_queue_figures_page_past_consumers_that_are_not_a_models(stack: Any, tiny: Path) -> None:
    """The request stream's consumer list is read a page (256) at a time; a page of consumers that
    are not `proc-<mtok>` ones still moves the listing on (it once asked for that page forever)."""
    from nats.js import api

    from schemas.subjects import REQUESTS_STREAM

    url, _, lg = stack
    for i in range(300):
        await lg.js.add_consumer(REQUESTS_STREAM, api.ConsumerConfig(
            durable_name=f"other-{i:03d}", filter_subject=f"ndif.req.other-{i:03d}", ack_policy=api.AckPolicy.EXPLICIT))
    try:
        async with Dashboard.from_url(url, port=0, queue_poll_s=0.2) as d, \
                aiohttp.ClientSession(headers=d.auth_headers()) as http:
            async with asyncio.timeout(20):
                while True:
                    status, q = await get(http, d.base_url.rstrip("/"), "/api/queues")
                    assert status == 200
                    if q.get("asked_at"):
                        break
                    await asyncio.sleep(0.2)
    finally:
        for i in range(300):
            await lg.js.delete_consumer(REQUESTS_STREAM, f"other-{i:03d}")


async def test_a_dashboard_starts_from_the_newest_snapshot_and_reaches_any_past_position(nats_server: EmbeddedNats) -> None:
    """On JetStream: the dashboard folds only the events after the stored snapshot; past positions
    before it (from an older snapshot plus events read from the log) and events pages equal the log's."""
    from controlplane.core.projections import ClusterState, fold, replay
    from controlplane.service.snapshots import SnapshotWriter
    from tests.strategies import numbered, scripted_history

    lg = await fresh_event_log(nats_server.url)
    events = scripted_history(12)
    for i in range(0, len(events), 10):
        await lg.append(events[i:i + 10], None)
    items = numbered(events)
    w = SnapshotWriter(lg, every=0, every_s=0)
    for cut in (15, 40):
        await w.write_now(fold(items[:cut], ClusterState()))
    try:
        async with Dashboard(lambda: _borrowed(lg), port=0, window=5) as d, \
                aiohttp.ClientSession(headers=d.auth_headers()) as http:
            base = d.base_url.rstrip("/")
            assert d.model.start_seq == 40 and len(d.model.items) <= 5 + 1
            status, body = await get(http, base, "/api/state")
            assert status == 200 and body["seq"] == len(items)
            assert d.model.live == replay(items)
            for seq in (3, 15, 27, 44):
                status, body = await get(http, base, f"/api/state?until={seq}")
                assert status == 200 and body["seq"] == seq and not body["live"]
                assert await d.past.at_seq(seq) == replay(items, until_seq=seq)  # type: ignore[union-attr]
            rows, before = [], None
            while True:
                q = "/api/events?limit=7" + (f"&before={before}" if before else "")
                status, page = await get(http, base, q)
                rows += page["events"]
                before = page["next_before"]
                if before is None:
                    break
            assert [r["seq"] for r in rows] == list(range(len(items), 0, -1))
    finally:
        await lg.close()


async def _borrowed(lg: JetStreamEventLog) -> Any:
    from controlplane.service.parts import Parts

    return Parts(lg, lg.nc)
