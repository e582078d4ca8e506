"""A simulated node for tests: the real `NodeAgent` over the real log, with an in-memory runtime.

No Ray or torch: the replica processes are tests/fake_runtime.py's. Everything the agent appends
is what it would append on a real node (dataplane/node/agent.py), with these differences in the
setting only: the drain is reported at once (`drain_timeout_s=0`, by the agent, as if the
dispatcher had nothing in flight), a fresh load takes `load_delay_s`, and `fail_loads(model_key)`
makes loads fail. `fail()` kills a replica's process (the agent's health check reports it),
`silence()` makes the node die (no more heartbeats or actions).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from controlplane.core.projections import ClusterState
from controlplane.store.eventstore import JetStreamEventLog
from controlplane.store.heartbeats import JetStreamHeartbeats
from dataplane.node.agent import NodeAgent
from schemas.events import GpuInfo
from schemas.status import ReplicaState
from schemas.subjects import HEARTBEATS_BUCKET, node_token
from tests.fake_runtime import FakeRuntime

S = ReplicaState
GB = 10**9


class ScriptedAgent:
    """A node: `NodeAgent` + `FakeRuntime`, started on `start()` (the agent is `self.agent`)."""

    def __init__(self, url: str, node_id: str, *, gpus: int = 8, gpu_bytes: int = 80 * GB,
                 cpu_cache_bytes: int = 200 * GB, load_delay_s: float = 0.0, heartbeat_s: float = 0.5,
                 fail_loads: Callable[[str], bool] = lambda mk: False, hostname: str = "sim",
                 gpu_name: str = "sim") -> None:
        self.url = url
        self.node_id = node_id
        self.hostname = hostname
        self.gpus = tuple(GpuInfo(index=i, memory_bytes=gpu_bytes, name=gpu_name) for i in range(gpus))
        self.cpu_cache_bytes = cpu_cache_bytes
        self.heartbeat_s = heartbeat_s
        self.runtime = FakeRuntime(f"sim:{node_id}", start_delay_s=load_delay_s, fail_loads=fail_loads)
        self.agent: NodeAgent | None = None
        self.beats: JetStreamHeartbeats | None = None

    @property
    def state(self) -> ClusterState:
        assert self.agent is not None
        return self.agent.state

    async def start(self) -> ScriptedAgent:
        log = await JetStreamEventLog.open(self.url, ensure=False, name=f"agent:{self.node_id}")
        self.beats = JetStreamHeartbeats(log.js, direct=True)
        self.agent = NodeAgent(log, self.beats, self.runtime, self.node_id, gpus=self.gpus,
                               cpu_cache_bytes=self.cpu_cache_bytes, heartbeat_s=self.heartbeat_s, drain_timeout_s=0.0,
                               health_interval_s=0.1, hostname=self.hostname, owns_log=True)
        await self.agent.start()
        return self

    async def stop(self) -> None:
        if self.agent is not None:
            await self.agent.stop()

    async def silence(self) -> None:
        """The node dies: no more heartbeats or actions, and its heartbeat key goes (as after its TTL)."""
        assert self.agent is not None and self.beats is not None
        await self.agent.halt()
        kv = await self.beats.js.key_value(HEARTBEATS_BUCKET)
        with contextlib.suppress(Exception):
            await kv.delete(node_token(self.node_id))

    async def fail(self, model_key: str, replica_id: int, error: str = "actor died") -> None:
        """Kill a replica's process behind the agent's back; the agent reports `ReplicaFailed`."""
        self.runtime.crash(model_key, replica_id, error)

    async def settled(self, timeout: float = 10.0) -> ClusterState:
        """Wait until no replica of this node is mid-transition (in this agent's own fold)."""
        moving = {S.LOAD_REQUESTED, S.LOADING, S.DRAINING, S.UNLOAD_REQUESTED, S.RESTARTING}
        async with asyncio.timeout(timeout):
            while any(r.node_id == self.node_id and r.state in moving for r in self.state.replicas.values()):
                await asyncio.sleep(0.02)
        return self.state
