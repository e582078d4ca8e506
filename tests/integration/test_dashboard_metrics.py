"""The dashboard's `/metrics` and plot series against a real nats-server, controller, scripted agent
and a real dispatcher (its replica calls go to the agent's in-memory processes: tests/fake_runtime.py).

Requests flow; `/metrics` is scraped and parsed by prometheus_client's text-format parser; its
figures are the log's (replicas, events, cards) and the dispatcher's (completed, latency); the
series endpoint gives the same queue figures over time, marked sampled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.dashboard import Dashboard
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from dataplane.client import Client
from dataplane.serving.dispatcher import Dispatcher
from schemas.keys import canonical_model_key
from tests.agent_sim import GB, ScriptedAgent
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log
from tests.fake_runtime import FakeCaller
from tests.integration.cluster import settle

pytestmark = pytest.mark.timeout(180)
N = 12


def families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


async def test_metrics_are_scraped_and_parsed_while_requests_flow(tiny_models: TinyModels, nats_server: EmbeddedNats, tmp_path: Path) -> None:
    url = nats_server.url
    ckpt = str(tiny_models.gpt2(tmp_path / "tiny-gpt2"))
    mk = canonical_model_key(ckpt)
    lg = await fresh_event_log(url)
    agent = ScriptedAgent(url, "node-a", gpus=2, cpu_cache_bytes=100 * GB)
    ctl = Controller.from_url(url, policy_interval_s=0.2)
    disp = Dispatcher.from_url(url, caller=FakeCaller([agent.runtime], run_s=0.02))
    disp.use_link = False
    parts = [ctl, agent]
    for p in parts:
        await p.start()
    admin = await AdminClient.open(url, timeout=20)
    try:
        await settle(admin)
        await admin.wait(await admin.deploy(ckpt, 2, size_bytes=10 * GB), timeout=20)
        await disp.start()
        parts.append(disp)
        async with Dashboard.from_url(url, port=0, queue_poll_s=0.2) as d, \
                aiohttp.ClientSession(headers=d.auth_headers()) as http:
            base = d.base_url.rstrip("/")
            async with asyncio.timeout(10):  # sampling runs before the requests: they are all seen
                while not d.samples.spans:
                    await asyncio.sleep(0.05)
            async with Client(url) as c:
                jobs = [await c.submit(ckpt, {"op": "echo", "data": i}) for i in range(N)]
                for i, j in enumerate(jobs):
                    assert (await j.result(timeout=30)) == {"echo": {"op": "echo", "data": i}}
                    await j.close()
            async with asyncio.timeout(10):  # the dashboard's next ask sees them
                while (d.queues["models"].get(mk) or {}).get("completed") != N:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)

            async with http.get(f"{base}/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                fams = families(await r.text())
            label = next(s[1]["model"] for s in fams["ndif_model_target_replicas"])
            assert label.endswith("tiny-gpt2")
            assert [v for _, lab, v in fams["ndif_replicas"] if lab == {"model": label, "level": "HOT"}] == [2]
            assert [v for _, lab, v in fams["ndif_model_status"] if lab["status"] == "Available"] == [1]
            assert [v for n, _, v in fams["ndif_requests_completed"] if n.endswith("_total")] == [N]
            assert [v for n, _, v in fams["ndif_requests_errors"] if n.endswith("_total")] == [0]
            lat = {lab["le"]: v for n, lab, v in fams["ndif_request_latency_seconds"] if n.endswith("_bucket")}
            assert lat["+Inf"] == N and all(a <= b for a, b in zip(list(lat.values()), list(lat.values())[1:], strict=False))
            assert [v for n, _, v in fams["ndif_request_latency_seconds"] if n.endswith("_count")] == [N]
            last = await lg.last_seq()
            assert fams["ndif_event_log_last_seq"][0][2] == last
            assert sum(v for n, _, v in fams["ndif_events"] if n.endswith("_total")) == last
            assert [v for _, _, v in fams["ndif_dispatcher_up"]] == [1]
            committed = {lab["gpu"]: v for _, lab, v in fams["ndif_gpu_memory_committed_bytes"] if lab["node"] == "node-a"}
            assert sum(committed.values()) == sum(d.model.live.card_committed("node-a", g) for g in (0, 1)) > 0

            # The same figures over time: sampled (marked so), the completions in the window.
            async with http.get(f"{base}/api/series", params={"model": "tiny-gpt2", "window": "60"}) as r:
                body = await r.json()
                assert r.status == 200, body
            q = body["queue"]
            assert q["sampled"] is True and q["sampled_since"] is not None
            assert sum(v * q["slice_s"] for v in q["completed_per_s"] if v) == pytest.approx(N)
            assert any(v for v in q["p50_s"] if v)
            assert body["replicas"]["HOT"][-1] == 2
            async with http.get(f"{base}/api/series", params={"node": "nope"}) as r:
                assert r.status == 400
            async with http.get(f"{base}/api/lifeline", params={"model": "tiny-gpt2", "window": "600"}) as r:
                line = await r.json()
            assert sorted(x["replica_id"] for x in line["replicas"]) == [0, 1]
            assert all(x["segments"][-1]["phase"] == "HOT" for x in line["replicas"])
    finally:
        await admin.close()
        for p in reversed(parts):
            await p.stop()
        await lg.close()
