"""Heartbeats behind their port (controlplane/core/ports.py `Heartbeats`): the in-memory store keeps
what the KV bucket keeps, and the real `NodeAgent` over it beats, refuses a node id whose agent is
alive, and takes one over after its agent's goodbye (no NATS, no Ray)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.core.ports import Heartbeat, Heartbeats
from controlplane.store.heartbeats import MemoryHeartbeats, heartbeat_ages
from controlplane.store.memlog import MemoryEventLog
from dataplane.node.agent import NodeAgent, NodeIdHeld
from tests.fake_runtime import FakeRuntime
from tests.strategies import node_joined
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)
NODE = "node-a.cluster"


async def test_the_memory_store_keeps_the_last_beat_and_the_goodbye() -> None:
    beats: Heartbeats = MemoryHeartbeats()
    assert await beats.last(NODE) is None
    await beats.beat(NODE)
    first = await beats.last(NODE)
    await beats.beat(NODE)
    second = await beats.last(NODE)
    assert first is not None and second is not None and second.seq > first.seq and not second.stopped
    await beats.goodbye(NODE)
    bye = await beats.last(NODE)
    assert bye is not None and bye.stopped and bye.seq > second.seq
    assert await beats.last("node-b") is None


async def test_ages_are_seconds_since_the_last_beat_or_none() -> None:
    beats = MemoryHeartbeats()
    beats.kept[NODE] = Heartbeat(at=datetime.now(UTC) - timedelta(seconds=30), seq=1)
    ages = await heartbeat_ages(beats, [NODE, "node-b"])
    assert ages["node-b"] is None and 29 <= (ages[NODE] or 0) <= 40
    assert Heartbeat(at=datetime.now(UTC) + timedelta(seconds=5), seq=1).age_s(datetime.now(UTC)) == 0.0


def _agent(log: MemoryEventLog, beats: MemoryHeartbeats, runtime: FakeRuntime) -> NodeAgent:
    return NodeAgent(log, beats, runtime, NODE, gpus=node_joined(NODE).gpus, cpu_cache_bytes=2**34,
                     heartbeat_s=0.05, drain_timeout_s=0.0, health_interval_s=0.05)


async def test_the_agent_beats_refuses_a_live_node_id_and_takes_one_over_after_a_goodbye() -> None:
    log, beats, runtime = MemoryEventLog(), MemoryHeartbeats(), FakeRuntime("sim:a")
    agent = await _agent(log, beats, runtime).start()
    try:
        first = await beats.last(NODE)
        assert first is not None and not first.stopped
        await until(lambda: (beats.kept[NODE].seq > first.seq))  # it keeps beating
        with pytest.raises(NodeIdHeld, match="held by a live agent"):
            await _agent(log, beats, runtime).start()
    finally:
        await agent.stop()
    bye = await beats.last(NODE)
    assert bye is not None and bye.stopped  # the goodbye
    again = await _agent(log, beats, runtime).start()  # taken over at once
    try:
        now = await beats.last(NODE)
        assert now is not None and not now.stopped
    finally:
        await again.stop()
