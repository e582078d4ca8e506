"""One poison message in the log stops no follower: the controller, a node's agent, the dispatcher's
follower and the dashboard each read past it (recorded as skipped) and go on doing their job.

The services run over the in-memory log (the same follow loop and fold as over JetStream;
tests/integration/test_poison.py does it on a real nats-server with the attackers' credentials).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import msgspec
import pytest

from controlplane.core.projections import ClusterState
from controlplane.dashboard import Dashboard
from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from dataplane.node.agent import NodeAgent
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.dispatcher.follower import LogFollower
from schemas import events as E
from schemas.commands import Deploy
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState
from schemas.subjects import node_subject, node_token, replica_subject
from tests.fake_runtime import FakeRuntime
from tests.unit.test_agent_plan import MemoryHeartbeats
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
NODE = "node-p"
GB = 10**9
DEEP_KEY = 'nnsight.modeling.language.LanguageModel:{"repo_id": ' + "[" * 3000 + "]" * 3000 + "}"


def poisons() -> list[tuple[str, bytes]]:
    """What an agent can append on its own subjects: the issue's two bodies and their kin."""
    now = datetime.now(UTC)
    deep_key = E.ReplicaLoaded(event_id="p-key", ts=now, actor=f"agent:{NODE}", model_key=DEEP_KEY, replica_id=0,
                               node_id=NODE)
    facts = f"{replica_subject('m', 0)}.{node_token(NODE)}"
    return [(node_subject(NODE), b"[" * 3000 + b"]" * 3000),  # 6 KB of nested arrays
            (node_subject(NODE), b'{"type":"NodeJoined","event_id":"\xff"}'),  # 36 bytes, invalid UTF-8
            (node_subject(NODE), b'{"type":"NodeJoined","x":' + b"[" * 3000 + b"]" * 3000 + b"}"),
            (facts, E.encode_event(deep_key)),  # a key whose JSON nests 3,000 levels
            (node_subject(NODE), b"\xff" * 100)]


async def test_every_follower_reads_past_poison(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    model = canonical_model_key(str(tmp_path), relative=False)
    log = MemoryEventLog()
    agent = NodeAgent(log, MemoryHeartbeats(), FakeRuntime("sim:p"), NODE,
                      gpus=tuple(E.GpuInfo(index=i, memory_bytes=80 * GB) for i in range(2)), cpu_cache_bytes=10 * GB,
                      heartbeat_s=0.05, drain_timeout_s=0.0, health_interval_s=0.05)
    disp_state = ClusterState()
    follower = LogFollower(log=log, state=disp_state, processors={}, intake=None, bg=Background(),  # type: ignore[arg-type]
                           name="dispatcher:test")
    async with Controller(Parts(log, None), policy_interval_s=0.05) as ctl, \
            Dashboard(Parts(log, None), port=0) as dash:
        await agent.start()
        following = asyncio.create_task(follower.run())
        try:
            for i, (subject, body) in enumerate(poisons()):
                await log.append_raw(subject, body, f"poison-{i}", datetime.now(UTC))
            last = await log.last_seq()
            await until(lambda: min(ctl.state.seq, agent.state.seq, disp_state.seq, dash.model.seq) >= last)
            for st in (ctl.state, agent.state, disp_state, dash.model.live):
                assert st.skipped == len(poisons()), st.skipped
            # Their jobs go on: a command is decided, the agent loads what it asks, all follow it.
            res = await ctl.handle(msgspec.json.encode(Deploy(command_id="after-poison", model_key=model,
                                                              size_bytes=GB)), verb="deploy")
            assert res.ok, res
            await until(lambda: agent.state.replicas.get((model, 0)) is not None
                        and agent.state.replicas[(model, 0)].state is ReplicaState.AVAILABLE)
            done = await log.last_seq()
            await until(lambda: min(ctl.state.seq, disp_state.seq, dash.model.seq) >= done)
        finally:
            following.cancel()
            await agent.stop()
