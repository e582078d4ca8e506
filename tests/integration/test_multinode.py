"""Several Ray nodes for real: a Ray head and two workers (`ray start` processes on loopback, each its
own raylet, labelled with its ndif node id), a real nats-server, the controller with the operator's
inventory of the three nodes, one `ndif agent` process per Ray node and an `ndif dispatcher`.

A model's replicas spread over the nodes (one per node: the failure domain), each replica's actor
runs on the Ray node its placement names (asked inside the actor), a request is served by a replica
on every node, and `ndif status` shows every node with its Ray node. Nodes differ (card kind and
memory, labels, from the inventory): `ndif deploy --require` lands only on nodes meeting it, and a
requirement no node meets is refused, naming what the closest node has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from dataplane.client import Client
from dataplane.ops.multinode import NodeSpec, running, served_by, until_available
from dataplane.ops.raynodes import RayNodes, probe
from schemas.keys import canonical_model_key
from schemas.requests import status_decoder
from schemas.status import Level, ReplicaState
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log
from tests.integration.cluster import config_only, ndif
from tests.waiting import until_state

# Each test takes about a minute on a loaded 2-core machine (three raylets, three agents, replica
# processes importing torch): run with --long, as the other multi-process fault tests.
pytestmark = [pytest.mark.timeout(300), pytest.mark.long, pytest.mark.usefixtures("starts_ray")]  # three `ray start` nodes
NODES = {"node-a": NodeSpec(count=1, gib=16, kind="A100", labels={"pool": "general"}),
         "node-b": NodeSpec(count=1, gib=16, kind="H100", labels={"pool": "research"}),
         "node-c": NodeSpec(count=2, gib=32, kind="H100", labels={"pool": "research"})}


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[RayNodes]:
    rn = RayNodes()
    try:
        rn.start("node-a", "node-b", "node-c")
        yield rn
    finally:
        rn.stop()


@pytest.fixture(scope="module")
def tiny(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.gpt2(tmp_path_factory.mktemp("ckpt") / "gpt2")


async def test_replicas_spread_over_ray_nodes_and_each_serves(nats_server: EmbeddedNats, ray_nodes: RayNodes,
                                                              tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with running(url, await fresh_event_log(url), ray_nodes, NODES) as st:
        res = await st.admin.deploy(str(tiny), 3)
        state = await st.admin.wait(res, timeout=150)
        reps = [r for r in state.model_replicas(mk) if r.state is ReplicaState.AVAILABLE]
        assert sorted(r.node_id for r in reps) == sorted(NODES), "one replica per node: nodes first, then cards"

        # Each actor runs on the Ray node its placement names (asked inside the actor), which is the
        # Ray node labelled with that ndif node id, which is what its agent announced.
        seen = probe(ray_nodes.address, ray_nodes.env)
        labelled = {n["node_id"]: n["ray_node_id"] for n in seen["nodes"] if n["alive"]}
        where = {a["replica_id"]: a["ray_node_id"] for a in seen["actors"] if a["model_key"] == mk}
        for r in reps:
            assert where[r.replica_id] == labelled[r.node_id] == state.nodes[r.node_id].ray_node_id
        assert len(set(labelled.values())) == 3

        statuses: list[Any] = []

        async def on_status(msg: Any) -> None:
            statuses.append(status_decoder.decode(msg.data))

        sub = await st.log.nc.subscribe("ndif.status.>", cb=on_status)
        try:
            async with Client(url) as c:
                payload = {"op": "forward", "input_ids": [[3, 1, 4, 1, 5]]}
                for _ in range(10):  # rounds of concurrent requests until every replica served one
                    jobs = [await c.submit(str(tiny), payload) for _ in range(12)]
                    await asyncio.gather(*(j.result(timeout=90) for j in jobs))
                    await asyncio.sleep(0.3)
                    if served_by(statuses) >= {r.replica_id for r in reps}:
                        break
            assert served_by(statuses) >= {r.replica_id for r in reps}
        finally:
            await sub.unsubscribe()

        status = (await ndif(url, "status", "--json")).json()
        rows = {n["node_id"]: n for n in status["nodes"]}
        assert set(rows) == set(NODES) and all(n["alive"] for n in rows.values())
        assert {n: rows[n]["ray_node_id"] for n in NODES} == {n: labelled[n] for n in NODES}
        text = (await ndif(url, "status")).out
        assert all(n in text for n in NODES)

        # Scale-down keeps the spread: a fourth replica doubles one node up (node-c has two cards);
        # back to three, the one removed is from that node, so each node still holds one.
        state = await st.admin.wait(await st.admin.scale(str(tiny), 4), timeout=150)
        hot = [r.node_id for r in state.model_replicas(mk) if r.state is ReplicaState.AVAILABLE]
        assert sorted(hot) == sorted([*NODES, "node-c"]), hot
        await st.admin.scale_down(str(tiny), 3)
        state = await until_state(st.admin, lambda s: sorted(
            r.node_id for r in s.model_replicas(mk) if r.desired is Level.HOT) == sorted(NODES), timeout=60)
        assert state.replica_count(mk) == 3


async def test_requirements_met_on_real_nodes_and_refused_with_their_reason(
        nats_server: EmbeddedNats, ray_nodes: RayNodes, tiny: Path, tmp_path: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    other = config_only(tmp_path, "other", tiny)
    async with running(url, await fresh_event_log(url), ray_nodes, NODES) as st:
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "2", "--require", "gpu=H100",
                         "--require", "pool=research", "--wait", "--wait-timeout", "150", timeout=180)
        assert ran.rc == 0, ran.err
        state = await until_available(st, mk, 2)
        assert sorted(r.node_id for r in state.model_replicas(mk)) == ["node-b", "node-c"]
        seen = probe(ray_nodes.address, ray_nodes.env)
        labelled = {n["node_id"]: n["ray_node_id"] for n in seen["nodes"] if n["alive"]}
        where = {a["replica_id"]: a["ray_node_id"] for a in seen["actors"] if a["model_key"] == mk}
        assert {where[r.replica_id] for r in state.model_replicas(mk)} == {labelled["node-b"], labelled["node-c"]}
        status = (await ndif(url, "status", "--json")).json()
        assert next(m for m in status["models"] if m["model_key"] == mk)["requires"] == ["gpu=H100", "pool=research"]
        assert {n["node_id"]: n["labels"] for n in status["nodes"]}["node-c"] == {"pool": "research"}

        before = await st.log.last_seq()
        ran = await ndif(url, "deploy", other, "--size-gib", "0.01", "--require", "gpu=H100",
                         "--require", "gpu-memory-gib=64")
        assert ran.rc == 2 and "64.00 GiB per card needed, has 32.00 GiB" in ran.err, (ran.rc, ran.err)
        ran = await ndif(url, "deploy", other, "--size-gib", "0.01", "--require", "pool=gpu-lab")
        assert ran.rc == 2 and "pool=gpu-lab needed, has pool=" in ran.err, (ran.rc, ran.err)
        assert await st.log.last_seq() == before  # refused before anything was appended
