"""The real node agent: real local Ray (declared GPUs), real nats-server, real tiny checkpoints.

Re-runs the controller issue's lifecycle scenario with the agent instead of the scripted one and
checks the actors behind each step; then failure, restart-after-SIGKILL and a corrupt checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.replica.actor import actor_name, parse_actor_name
from dataplane.runtime.ray_adapter import get_actor, kill_actor, list_replica_actors
from schemas.keys import canonical_model_key
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log
from tests.dataplane.conftest import kill_all_actors
from tests.integration.cluster import ndif
from tests.integration.scenario import lifecycle_scenario
from tests.waiting import until_state

pytestmark = pytest.mark.timeout(300)
GB = 10**9
IDS = [[5, 17, 42, 7]]


@pytest.fixture(scope="module")
def tiny(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.gpt2(tmp_path_factory.mktemp("ckpt") / "tiny-gpt2")


@pytest_asyncio.fixture
async def log(nats_server: EmbeddedNats, local_ray: str) -> AsyncIterator[JetStreamEventLog]:
    kill_all_actors()
    lg = await fresh_event_log(nats_server.url)
    yield lg
    await lg.close()
    kill_all_actors()


@pytest_asyncio.fixture
async def admin(nats_server: EmbeddedNats, log: JetStreamEventLog) -> AsyncIterator[AdminClient]:
    async with await AdminClient.open(nats_server.url, timeout=30) as a:
        yield a


async def agent(url: str, **kw: Any) -> NodeAgent:
    return await NodeAgent.open(url, "node-a", gpus=declared_gpus(2, 80 * GB), cpu_cache_bytes=10 * GB,
                                heartbeat_s=0.2, drain_timeout_s=0.2, health_interval_s=0.2, **kw)


async def info(mk: str, rid: int) -> dict[str, Any] | None:
    h = get_actor(mk, rid)
    return None if h is None else await h.info.remote()


async def test_lifecycle_with_real_actors(nats_server: EmbeddedNats, admin: AdminClient, tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    pids: dict[int, int] = {}

    async def actors_match(step: str, status: dict[str, Any]) -> None:
        """Reality behind `ndif status`: one contract-named actor per HOT/WARM replica, at that level."""
        wanted = {r["replica_id"]: r["level"] for r in status["replicas"] if r["level"] in ("HOT", "WARM")}
        live = {rid for m, rid, _ in list_replica_actors() if m == mk}
        assert live == set(wanted), (step, live, wanted)
        for rid, level in wanted.items():
            i = await info(mk, rid)
            assert i is not None and i["level"] == level and i["node_id"] == "node-a", (step, rid, i)
        hot = [rid for rid, lv in wanted.items() if lv == "HOT"]
        outs = [await get_actor(mk, rid).__call__.remote({"op": "forward", "input_ids": IDS}) for rid in hot]
        assert all(o == outs[0] for o in outs), step  # replicas of one checkpoint answer alike
        if step == "evict_one":
            assert (await info(mk, 2))["cpu_bytes"] == 689152  # weights held in CPU memory
            pids[2] = (await info(mk, 2))["pid"]
        if step == "scale_back":
            assert (await info(mk, 2))["pid"] == pids[2]  # the same actor, loaded again from its cache
        if step == "scale":
            pids[0] = (await info(mk, 0))["pid"]
        if step == "restart":
            assert (await info(mk, 0))["pid"] != pids[0]  # a new process under the same name and id

    async with Controller.from_url(url, policy_interval_s=0.2), await agent(url):
        await lifecycle_scenario(url, admin, tiny, node="node-a", drainer="agent:node-a", on_step=actors_match,
                                 settle_timeout=90)
    assert not list_replica_actors()  # evict --all --cold: no actor left


async def test_killed_actor_fails_and_the_policy_restarts_it(nats_server: EmbeddedNats, admin: AdminClient,
                                                            tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with Controller.from_url(url, policy_interval_s=0.1), await agent(url):
        res = await admin.deploy(str(tiny), 1)
        await admin.wait(res, timeout=90)
        before = await info(mk, 0)
        killed_at = datetime.now(UTC)
        kill_actor(get_actor(mk, 0))
        st = await until_state(admin, lambda s: s.replicas[(mk, 0)].restarts == 1
                         and s.replicas[(mk, 0)].state == "Available", timeout=90)
        events = [e async for _, e in admin.events(model=str(tiny))]
        failed = [e for e in events if type(e).__name__ == "ReplicaFailed"]
        assert len(failed) == 1 and "died" in failed[0].error
        lag = (failed[0].ts - killed_at).total_seconds()
        assert 0 <= lag < 10, lag  # seen within seconds (health pings every 0.2 s here)
        after = await info(mk, 0)
        assert after is not None and after["level"] == "HOT" and after["pid"] != before["pid"]
        assert st.anomaly_count == 0, st.anomalies


def run_agent_process(url: str, gcs: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NDIF_LOG_LEVEL": "INFO"}
    return subprocess.Popen(
        [sys.executable, "-m", "dataplane.ops.cli", "agent", "--nats", url, "--ray-address", gcs, "--node-id", "node-a",
         "--gpus", "2", "--gpu-memory-gib", "80", "--cpu-cache-gib", "10", "--drain-timeout", "0.2",
         "--heartbeat", "0.2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def test_agent_sigkilled_mid_load_restarts_without_orphans(nats_server: EmbeddedNats, admin: AdminClient,
                                                                 log: JetStreamEventLog, tiny: Path,
                                                                 local_ray: str) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with Controller.from_url(url, policy_interval_s=0.1):
        proc = run_agent_process(url, local_ray)
        try:
            await until_state(admin, lambda s: "node-a" in s.nodes, timeout=60)
            res = await admin.deploy(str(tiny), 3)
            # SIGKILL the agent while the replicas are loading (Loading appended, not yet Loaded).
            await until_state(admin, lambda s: any(r.state == "Loading" for r in s.replicas.values()), timeout=60)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            mid = await admin.state()
            assert any(r.state != "Available" for r in mid.replicas.values())  # it really was mid-load
            proc = run_agent_process(url, local_ray)
            st = await admin.wait(res, timeout=120)
            assert all(st.replicas[(mk, i)].state == "Available" for i in range(3))
            await asyncio.sleep(1.0)  # anything the restarted agent would still do
            names = sorted(name for _, _, name in list_replica_actors())
            assert names == sorted(actor_name(mk, i) for i in range(3))  # exactly one actor per replica
            st = await admin.state()
            assert st.anomaly_count == 0, st.anomalies
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)


async def test_corrupt_checkpoint_load_fails_and_frees_its_cards(nats_server: EmbeddedNats, admin: AdminClient,
                                                                 tiny: Path, tmp_path: Path) -> None:
    url = nats_server.url
    bad = tmp_path / "corrupt"
    bad.mkdir()
    for f in tiny.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": "sixty-four"}))
    mk_bad, mk_ok = canonical_model_key(str(bad)), canonical_model_key(str(tiny))
    async with Controller.from_url(url, policy_interval_s=0.1), await agent(url):
        ok = await admin.deploy(str(tiny), 1)
        await admin.wait(ok, timeout=90)
        res = await admin.deploy(str(bad), 1, size_bytes=10 * GB)
        st = await admin.wait(res, timeout=90)
        r = st.replicas[(mk_bad, 0)]
        assert (r.state == "LoadFailed" and r.error and "sixty-four" in r.error) or "int" in (r.error or "")
        cards = st.node_cards("node-a")
        assert all(not any(m == mk_bad for m, _, _ in c.replicas) for c in cards)  # reservation freed
        assert st.replicas[(mk_ok, 0)].state == "Available"  # nothing else disturbed
        assert get_actor(mk_bad, 0) is None and get_actor(mk_ok, 0) is not None
        assert st.anomaly_count == 0, st.anomalies
        assert parse_actor_name(actor_name(mk_ok, 0)) == (mk_ok, 0)


async def test_ndif_logs_shows_the_replica_processs_own_lines(nats_server: EmbeddedNats, admin: AdminClient,
                                                              tiny: Path) -> None:
    """Under Ray the replica actor keeps its own lines (its structlog events, e.g. `replica_loaded`)
    and `ndif logs` shows them beside the agent's, in time order."""
    url = nats_server.url
    async with Controller.from_url(url, policy_interval_s=0.2), await agent(url):
        res = await admin.deploy(str(tiny), 1)
        await admin.wait(res, timeout=90)
        ran = await ndif(url, "logs", str(tiny), "--replica-id", "0")
        assert ran.rc == 0, ran.err
        block = ran.out.split("<==", 1)[1]
        assert "replica: info replica_loaded" in block, ran.out
        assert block.index("replica: info replica_loaded") < block.index("agent: ReplicaLoaded"), ran.out
        assert "note:" not in ran.err and "could not be read" not in ran.out, (ran.out, ran.err)
        ran = await ndif(url, "logs", str(tiny), "--replica-id", "0", "--json")
        row = json.loads(ran.out)["replicas"][0]
        assert ran.rc == 0 and row["ok"] and "missing" not in row, row
        shape = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z replica: info replica_loaded model_key=\S.* replica_id=0 .*" \
                r"seconds=[\d.]+ devices=\[\d\]"
        assert any(re.match(shape, ln) for ln in row["lines"]), row
