"""A node lost under traffic, on real multi-node Ray on loopback (a head and two workers, each a `ray
start` process with its own raylet), a real nats-server, the controller, an `ndif agent` per node and
an `ndif dispatcher` (dataplane/ops/multinode.py), the scenario of dataplane/ops/nodeloss.py.

Two replicas of a tiny GPT-2 spread over two of the three nodes; requests flow; the worker node
holding one is SIGKILLed (its whole `ray start` process group and its agent). With a 5 s heartbeat
grace: NodeLost, the replica placed again on the third node (spread kept: never beside the
survivor), loaded, requests completing on it; every request submitted ends COMPLETED, each with
exactly one terminal status. The node started again (same id, address, inventory) rejoins
(NodeJoined) and takes the replica of the next scale-up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from dataplane.ops.multinode import NodeSpec, running
from dataplane.ops.nodeloss import node_loss
from dataplane.ops.raynodes import RayNodes
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log

# About 100 s on a loaded 2-core machine (three raylets started one after another, three
# agents, replica processes importing torch, a node killed and started again): run with --long.
pytestmark = [pytest.mark.timeout(600), pytest.mark.long, pytest.mark.usefixtures("starts_ray")]  # three `ray start` nodes
NODES = {n: NodeSpec(count=1, gib=16) for n in ("node-a", "node-b", "node-c")}
GRACE_S = 5.0


@pytest.fixture
def ray_nodes() -> Iterator[RayNodes]:
    rn = RayNodes()
    try:
        rn.start(*NODES)
        yield rn
    finally:
        rn.stop()


async def test_node_killed_under_traffic_loses_nothing_and_rejoins(tiny_models: TinyModels, nats_server: EmbeddedNats, ray_nodes: RayNodes,
                                                                   tmp_path: Path) -> None:
    tiny = tiny_models.gpt2(tmp_path / "gpt2")
    url = nats_server.url
    async with running(url, await fresh_event_log(url), ray_nodes, NODES, heartbeat_grace_s=GRACE_S) as st:
        run = await node_loss(st, str(tiny), replicas=2, heartbeat_grace_s=GRACE_S, head="node-a")
    figures = run.figures()
    print(json.dumps(figures))
    assert run.victim != "node-a"
    assert len(run.submitted) >= 10, figures
    assert run.failed == {} and run.lost == 0, (run.failed, figures)
    assert all(run.completed[r] == 1 and run.terminal[r] == 1 for r in run.submitted), figures
    # Placed again on the node with room, not beside the survivor: one replica per node, off the lost one.
    assert run.replaced_on not in (None, run.victim)
    assert len(run.spread) == 2 and len(set(run.spread)) == 2 and run.victim not in run.spread, figures
    assert run.detect_s is not None and run.detect_s >= GRACE_S - 1, figures  # the grace, not something sooner
    # Rejoined as the Ray node started again (its agent found the fresh raylet by its label), and used.
    assert run.ray_node_before and run.ray_node_after not in ("", run.ray_node_before), figures
    assert run.rejoined_replica_on == run.victim, figures
