"""The service over a real multi-node Ray on loopback (raynodes.py), for tests and benchmarks: a controller with the
operator's inventory of every node, one `ndif agent` process per Ray node (found by its label, so
its replicas are pinned to that node), an `ndif dispatcher` process, an admin client, on fresh
streams.

The agents and the dispatcher are processes of their own joined to that Ray (the test process stays
out of Ray: its session's local Ray may be up), and a test can SIGKILL an agent with its node's
raylet, as a machine dying would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.ops.nats_server import stop_process
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.ops.raynodes import RayNodes
from dataplane.ops.waiting import dispatcher_answering, until_state
from schemas.inventory import CardGroup, Inventory, NodeInventory
from schemas.status import ReplicaState, RequestStatus

GiB = 2**30


@dataclass
class NodeSpec:
    """One node: its cards (count, GiB each, kind) and labels, declared and reported alike."""

    count: int = 1
    gib: int = 16
    kind: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def inventory(self) -> NodeInventory:
        return NodeInventory(cards=(CardGroup(count=self.count, memory_bytes=self.gib * GiB, kind=self.kind),),
                             labels=self.labels)


@dataclass
class Stack:
    url: str
    rn: RayNodes
    specs: dict[str, NodeSpec]
    controller: Controller
    admin: AdminClient
    log: JetStreamEventLog
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    dispatcher: subprocess.Popen[bytes] | None = None

    def _process(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = {**self.rn.env, "NDIF_LOG_LEVEL": os.environ.get("NDIF_TEST_PROC_LOG_LEVEL", "WARNING")}
        with open(self.rn.root / f"{name}.log", "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "dataplane.ops.cli", *args, "--nats", self.url,
                                     "--ray-address", self.rn.address], env=env, stdout=out, stderr=out)

    def start_agent(self, node_id: str, heartbeat_s: float = 0.5) -> subprocess.Popen[bytes]:
        spec = self.specs[node_id]
        proc = self._process(f"agent-{node_id}", "agent", "--node-id", node_id, "--gpus", str(spec.count),
                             "--gpu-memory-gib", str(spec.gib), "--cpu-cache-gib", "1",
                             "--heartbeat", str(heartbeat_s), "--drain-timeout", "5")
        self.agents[node_id] = proc
        return proc

    def kill_agent(self, node_id: str) -> None:
        proc = self.agents.pop(node_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    async def nodes_alive(self, nodes: list[str], timeout: float = 90.0) -> None:
        await until_state(self.admin, lambda s: all(n in s.nodes and s.nodes[n].alive for n in nodes), timeout)


def inventory(specs: dict[str, NodeSpec]) -> Inventory:
    return Inventory(nodes={n: s.inventory() for n, s in specs.items()})


@contextlib.asynccontextmanager
async def running(url: str, lg: JetStreamEventLog, rn: RayNodes, specs: dict[str, NodeSpec], *,
                  heartbeat_grace_s: float = 20.0) -> AsyncIterator[Stack]:
    """Controller (the inventory of `specs`), an agent per node of `specs`, the dispatcher; every node
    up. Over the log `lg` on `url` (the caller's, on the streams it wants); closed on the way out."""
    ctl = await Controller.from_url(url, policy_interval_s=0.3, heartbeat_grace_s=heartbeat_grace_s,
                                    inventory=inventory(specs)).start()
    admin = await AdminClient.open(url, timeout=30)
    stack = Stack(url, rn, specs, ctl, admin, lg)
    try:
        for node_id in specs:
            stack.start_agent(node_id)
        stack.dispatcher = stack._process("dispatcher", "dispatcher")
        await stack.nodes_alive(list(specs))
        await dispatcher_answering(lg)
        yield stack
    finally:
        for proc in [*stack.agents.values(), *([stack.dispatcher] if stack.dispatcher else [])]:
            stop_process(proc, signal.SIGTERM, 20)
        for what, step in (("admin.close", admin.close()), ("controller.stop", ctl.stop()),
                           ("log.close", lg.close())):
            try:
                await asyncio.wait_for(step, 30)
            except TimeoutError:
                raise AssertionError(f"teardown step {what!r} did not finish within 30 s") from None


async def until_available(st: Stack, model_key: str, n: int, timeout: float = 150.0) -> ClusterState:
    """The fold once `n` replicas of the model are Available."""
    return await until_state(st.admin, lambda s: sum(r.state is ReplicaState.AVAILABLE
                                                     for r in s.model_replicas(model_key)) >= n, timeout)


def served_by(statuses: list[Any]) -> set[int]:
    """Replica ids that completed a request, from status updates."""
    return {s.replica_id for s in statuses if s.replica_id is not None and s.status is RequestStatus.COMPLETED}
