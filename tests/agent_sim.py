"""A scripted node agent for tests: plays a node (and the dispatcher's drain report) through the real log.

It does what the real agent (dataplane/node/agent.py) does to the event log, without Ray or torch:
appends `NodeJoined`, keeps a KV heartbeat, folds the stream and reconciles its node's replicas:

    LoadRequested   -> ReplicaLoading, then ReplicaLoaded (or ReplicaLoadFailed for `fail_loads` models)
    Loading         -> ReplicaLoaded            (an agent restarted mid-load finishes it)
    Draining        -> ReplicaDrained           (as the dispatcher would, once idle)
    UnloadRequested -> ReplicaCached (desired WARM) or ReplicaUnloaded (desired COLD)
    Restarting      -> ReplicaRestarted

It is level-triggered (acts on folded state, not on single events), so a restart re-folds and
finishes what was pending. Observed facts are appended unguarded (`expected_last_seq=None`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from controlplane.context import observed
from controlplane.eventstore import JetStreamEventLog
from controlplane.projections import ClusterState
from schemas.events import (
    Event,
    GpuInfo,
    NodeJoined,
    ReplicaCached,
    ReplicaDrained,
    ReplicaFailed,
    ReplicaLoaded,
    ReplicaLoadFailed,
    ReplicaLoading,
    ReplicaRestarted,
    ReplicaUnloaded,
)
from schemas.status import Level, ReplicaState
from schemas.subjects import HEARTBEATS_BUCKET, node_token

log = structlog.get_logger("tests.agent_sim")
S = ReplicaState
GB = 10**9


class ScriptedAgent:
    def __init__(self, url: str, node_id: str, *, gpus: int = 8, gpu_bytes: int = 80 * GB,
                 cpu_cache_bytes: int = 200 * GB, load_delay_s: float = 0.0, heartbeat_s: float = 0.5,
                 fail_loads: Callable[[str], bool] = lambda mk: False) -> None:
        self.url = url
        self.node_id = node_id
        self.gpus = tuple(GpuInfo(index=i, memory_bytes=gpu_bytes, name="sim") for i in range(gpus))
        self.cpu_cache_bytes = cpu_cache_bytes
        self.load_delay_s = load_delay_s
        self.heartbeat_s = heartbeat_s
        self.fail_loads = fail_loads
        self.actor = f"agent:{node_id}"
        self.state = ClusterState()
        self.log: JetStreamEventLog | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._done: set[tuple[object, ...]] = set()  # marks of what was acted upon
        self.appended: list[Event] = []

    async def start(self, *, join: bool = True) -> ScriptedAgent:
        self.log = await JetStreamEventLog.open(self.url, ensure=False, name=self.actor)
        async for batch in self.log.read_batches():
            for seq, item in batch:
                self.state.apply(seq, item)
        await self.heartbeat_once()
        if join:
            await self._append(observed(NodeJoined, actor=self.actor, node_id=self.node_id, gpus=self.gpus,
                                        cpu_cache_bytes=self.cpu_cache_bytes, hostname="sim"))
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        self._tasks.append(asyncio.create_task(self._follow()))
        return self

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self.log is not None:
            await self.log.close()

    async def silence(self) -> None:
        """Stop heartbeating and drop the heartbeat key, as a dead node would after its TTL."""
        assert self.log is not None
        self._tasks[0].cancel()
        kv = await self.log.js.key_value(HEARTBEATS_BUCKET)
        with contextlib.suppress(Exception):
            await kv.delete(node_token(self.node_id))

    async def fail(self, model_key: str, replica_id: int, error: str = "actor died") -> None:
        """Report a replica's actor as dead (what the real agent sees when Ray loses it)."""
        await self._append(observed(ReplicaFailed, actor=self.actor, model_key=model_key, replica_id=replica_id,
                                    node_id=self.node_id, error=error))

    async def heartbeat_once(self) -> None:
        assert self.log is not None
        kv = await self.log.js.key_value(HEARTBEATS_BUCKET)
        await kv.put(node_token(self.node_id), self.node_id.encode())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            with contextlib.suppress(Exception):
                await self.heartbeat_once()

    async def _append(self, ev: Event) -> None:
        assert self.log is not None
        await self.log.append([ev], None)
        self.appended.append(ev)

    async def _follow(self) -> None:
        assert self.log is not None
        while True:  # like the real agent: a server crash interrupts the follow, it goes on from where it was
            try:
                await self._reconcile()
                async for batch in self.log.follow_batches(self.state.seq + 1):
                    for seq, item in batch:
                        self.state.apply(seq, item)
                    await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. an append timed out in a server crash: fold on, act again
                log.warning("sim_follow_restarting", node_id=self.node_id, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(0.5)

    async def _reconcile(self) -> None:
        """Act on every replica of this node whose state asks something of the node, in id order."""
        mine = sorted((r for r in self.state.replicas.values() if r.node_id == self.node_id),
                      key=lambda r: (r.since_seq, r.model_key, r.replica_id))
        # Unloads before loads: a card is freed before the replica scheduled onto it starts.
        mine.sort(key=lambda r: r.state is not S.UNLOAD_REQUESTED and r.state is not S.DRAINING)
        for r in mine:
            # One load per scheduling (Loading then Loaded are one action); other steps once per state.
            loading = r.state in (S.LOAD_REQUESTED, S.LOADING)
            mark = (r.model_key, r.replica_id, "load", r.scheduled_at) if loading else (r.model_key, r.replica_id,
                                                                                          r.since_seq)
            if mark in self._done:
                continue
            kw = {"actor": self.actor, "model_key": r.model_key, "replica_id": r.replica_id, "node_id": self.node_id}
            match r.state:
                case S.LOAD_REQUESTED | S.LOADING:
                    self._done.add(mark)
                    if r.state is S.LOAD_REQUESTED:
                        await self._append(observed(ReplicaLoading, **kw))
                    if self.load_delay_s:
                        await asyncio.sleep(self.load_delay_s)
                    if self.fail_loads(r.model_key):
                        await self._append(observed(ReplicaLoadFailed, error="sim: config.json is corrupt", **kw))
                    else:
                        await self._append(observed(ReplicaLoaded, load_seconds=self.load_delay_s, **kw))
                case S.DRAINING:
                    self._done.add(mark)
                    await self._append(observed(ReplicaDrained, **{**kw, "actor": "dispatcher:sim"}))
                case S.UNLOAD_REQUESTED:
                    self._done.add(mark)
                    reg = self.state.models[r.model_key].registration
                    if r.desired is Level.WARM and reg is not None:
                        await self._append(observed(ReplicaCached, cpu_bytes=reg.size_bytes, **kw))
                    else:
                        await self._append(observed(ReplicaUnloaded, **kw))
                case S.RESTARTING:
                    self._done.add(mark)
                    await self._append(observed(ReplicaRestarted, **kw))
                case _:
                    pass

    async def settled(self, timeout: float = 10.0) -> ClusterState:
        """Wait until no replica of this node is mid-transition (in this agent's own fold)."""
        moving = {S.LOAD_REQUESTED, S.LOADING, S.DRAINING, S.UNLOAD_REQUESTED, S.RESTARTING}
        async with asyncio.timeout(timeout):
            while any(r.node_id == self.node_id and r.state in moving for r in self.state.replicas.values()):
                await asyncio.sleep(0.02)
        return self.state
