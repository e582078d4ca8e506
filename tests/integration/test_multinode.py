"""Several Ray nodes for real: a Ray head and two workers (`ray start` processes on loopback, each its
own raylet, labelled with its ndif node id), a real nats-server, the controller with the operator's
inventory of the three nodes, one `ndif agent` process per Ray node and an `ndif dispatcher`.

A model's replicas spread over the nodes (one per node: the failure domain), each replica's actor
runs on the Ray node its placement names (asked inside the actor), a request is served by a replica
on every node, and `ndif status` shows every node with its Ray node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from dataplane.client import Client
from dataplane.node.tiny_models import make_tiny_gpt2
from schemas.keys import canonical_model_key
from schemas.requests import status_decoder
from schemas.status import ReplicaState
from tests.integration.cluster import ndif
from tests.multinode import NodeSpec, running, served_by
from tests.raynodes import RayNodes, probe

pytestmark = pytest.mark.timeout(240)
NODES = {"node-a": NodeSpec(count=1, gib=16), "node-b": NodeSpec(count=1, gib=16), "node-c": NodeSpec(count=2, gib=16)}


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[RayNodes]:
    rn = RayNodes()
    try:
        rn.head("node-a")
        rn.wait_started()
        rn.worker("node-b")
        rn.worker("node-c")
        rn.wait_started()
        yield rn
    finally:
        rn.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gpt2(tmp_path_factory.mktemp("ckpt") / "gpt2")


async def test_replicas_spread_over_ray_nodes_and_each_serves(nats_server: EmbeddedNats, ray_nodes: RayNodes,
                                                              tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with running(url, ray_nodes, NODES) as st:
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
