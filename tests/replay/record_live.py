"""Record a golden history from the live services: the real `Controller` over a real nats-server.

    python -m tests.replay.record_live      # rewrites tests/replay/histories/v1_live_lifecycle.*

The run is tests/integration's lifecycle and policies scenarios: a `Controller` and two scripted
node agents (tests/agent_sim.py) on an embedded nats-server, commands sent through `AdminClient`.
The history is the stream as stored. Its decisions are read back from it: a decision is a run of
consecutive events with one command id; its context is what the controller built (the time in its
events, their actor and command id, `controller.seed_of`); its input is the command this script
sent under that id (with the registration its `ModelRegistered` records), or the policy its first
event shows (`NodeLost`: node_lost; a restart or a `failure` eviction: failure; a `node-lost`
eviction of a lost replica: unplaced). tests/replay/test_recorded_decisions.py re-decides each over
its prefix, so it also checks that the controller gives the pure core nothing but what its events
record. Timestamps are the run's: re-recording writes other bytes, the same story.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.core.projections.cluster import Registration
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller, seed_of
from controlplane.service.logs import configure
from controlplane.store.admin import AdminClient
from schemas import events as E
from schemas.commands import AnyCommand, Deploy, Evict, Restart, Scale, ScaleDown, Undeploy
from schemas.keys import canonical_model_key
from schemas.status import EvictionReason, Level, ReplicaState
from tests.agent_sim import ScriptedAgent
from tests.conftest import fresh_event_log
from tests.replay.record import (
    CommandPolicy,
    Context,
    Decision,
    FailurePolicy,
    NodeLostPolicy,
    Policy,
    Settings,
    UnplacedPolicy,
    write_history,
)
from tests.waiting import until_state

NAME = "v1_live_lifecycle"
GB = 10**9
MODELS = Path("/tmp/ndif-rec-models")  # fixed paths: the model keys in the history name them
MOVING = {ReplicaState.LOAD_REQUESTED, ReplicaState.LOADING, ReplicaState.DRAINING, ReplicaState.UNLOAD_REQUESTED,
          ReplicaState.RESTARTING}
SETTINGS = Settings(max_restarts=1)


def _checkpoint(name: str) -> str:
    d = MODELS / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return str(d)


async def _until(admin: AdminClient, pred: Any, timeout: float = 20.0) -> ClusterState:
    """`pred` holds and no replica is on its way between levels."""
    return await until_state(admin, lambda s: pred(s) and not any(r.state in MOVING for r in s.replicas.values()),
                             timeout)


async def run_scenario(url: str) -> dict[str, AnyCommand]:
    tiny, big = canonical_model_key(_checkpoint("tiny")), canonical_model_key(_checkpoint("big"))
    sent: dict[str, AnyCommand] = {}
    ctl = Controller.from_url(url, name="controller:rec", max_restarts=SETTINGS.max_restarts, heartbeat_grace_s=1.5,
                     policy_interval_s=0.1, min_deploy_s=SETTINGS.min_deploy_s, headroom=SETTINGS.headroom)
    a = ScriptedAgent(url, "node-a", gpus=2, cpu_cache_bytes=10 * GB, heartbeat_s=0.1)
    b = ScriptedAgent(url, "node-b", gpus=2, cpu_cache_bytes=10 * GB, heartbeat_s=0.1)
    agents = {"node-a": a, "node-b": b}
    await ctl.start()
    await a.start()
    await b.start()
    try:
        async with await AdminClient.open(url, timeout=20) as admin:
            async def send(cmd: AnyCommand) -> None:
                sent[cmd.command_id] = cmd
                res = await admin.command(cmd)
                assert res.ok, res
                await _until(admin, lambda s: True)

            def cmd(cls: type, cid: str, **fields: object) -> AnyCommand:
                return cls(command_id=cid, actor="cli:operator", **fields)  # type: ignore[no-any-return]

            await _until(admin, lambda s: len(s.nodes) == 2)
            for n in range(4):
                c = f"live{n}"
                await send(cmd(Deploy, f"{c}-deploy", model_key=tiny, replicas=1, size_bytes=689152))
                await send(cmd(Scale, f"{c}-scale", model_key=tiny, replicas=2))
                await send(cmd(Scale, f"{c}-scale-up", model_key=tiny, replicas=1, scale_up=True))
                st = await admin.state()
                hot = [r.replica_id for r in st.model_replicas(tiny) if r.desired is Level.HOT]
                await send(cmd(Evict, f"{c}-evict-one", model_key=tiny, replica_id=hot[1]))
                await send(cmd(Scale, f"{c}-scale-back", model_key=tiny, replicas=3))
                await send(cmd(Restart, f"{c}-restart", model_key=tiny, replica_id=hot[0]))
                await send(cmd(ScaleDown, f"{c}-scale-down", model_key=tiny, replicas=1))
                await send(cmd(Evict, f"{c}-evict-all-cold", all=True, cold=True))

                await send(cmd(Deploy, f"{c}-deploy-big", model_key=big, replicas=1, size_bytes=50 * GB))
                st = await admin.state()
                (r0,) = [r for r in st.model_replicas(big) if r.desired is Level.HOT]
                await agents[r0.node_id].fail(big, r0.replica_id, "CUDA error: illegal memory access")
                await _until(admin, lambda s: s.replicas[(big, r0.replica_id)].restarts == 1)  # noqa: B023
                await agents[r0.node_id].fail(big, r0.replica_id, "CUDA error again")  # past max_restarts
                st = await _until(admin, lambda s: any(r.desired is Level.HOT and r.state is ReplicaState.AVAILABLE
                                                       and r.replica_id != r0.replica_id  # noqa: B023
                                                       for r in s.model_replicas(big)))
                (r1,) = [r for r in st.model_replicas(big) if r.desired is Level.HOT]
                lost = agents[r1.node_id]
                await lost.silence()  # NodeLost; its replica placed on the other node
                await _until(admin, lambda s: not s.nodes[lost.node_id].alive and any(  # noqa: B023
                    r.desired is Level.HOT and r.state is ReplicaState.AVAILABLE for r in s.model_replicas(big)))
                await lost.stop()
                agents[lost.node_id] = fresh = ScriptedAgent(url, lost.node_id, gpus=2, cpu_cache_bytes=10 * GB,
                                                             heartbeat_s=0.1)
                await fresh.start()  # rejoins
                await _until(admin, lambda s: s.nodes[fresh.node_id].alive)  # noqa: B023
                await send(cmd(Undeploy, f"{c}-undeploy-tiny", model_key=tiny))
                await send(cmd(Undeploy, f"{c}-undeploy-big", model_key=big))
                await _until(admin, lambda s: not s.models)
    finally:
        for agent in agents.values():
            await agent.stop()
        await ctl.stop()
    return sent


def _policy(group: list[E.Event], sent: dict[str, AnyCommand]) -> Policy:
    head = group[0]
    if isinstance(head, E.CommandDecided):
        reg = next((Registration(checkpoint=e.checkpoint, revision=e.revision, size_bytes=e.size_bytes, dtype=e.dtype)
                    for e in group if isinstance(e, E.ModelRegistered)), None)
        return CommandPolicy(command=sent[head.command_id or ""], registration=reg)
    if isinstance(head, E.NodeLost):
        return NodeLostPolicy(node_id=head.node_id, reason=head.reason)
    if isinstance(head, E.ReplicaRestartRequested) or (
            isinstance(head, E.ReplicaEvictionRequested) and head.reason is EvictionReason.FAILURE):
        return FailurePolicy(model_key=head.model_key, replica_id=head.replica_id)
    if isinstance(head, E.ReplicaEvictionRequested) and head.reason is EvictionReason.NODE_LOST:
        return UnplacedPolicy()
    raise ValueError(f"no decision starts with {head!r}")


def decisions_of(events: list[E.Event], sent: dict[str, AnyCommand]) -> list[Decision]:
    """The history's decisions: runs of consecutive events with one command id."""
    out: list[Decision] = []
    i = 0
    while i < len(events):
        cid = events[i].command_id
        if cid is None:
            i += 1
            continue
        j = i
        while j < len(events) and events[j].command_id == cid:
            j += 1
        group = events[i:j]
        head = group[0]
        out.append(Decision(on=_policy(group, sent), settings=SETTINGS, at_seq=i, events=j - i,  # type: ignore[arg-type]
                            ctx=Context(now=head.ts, actor=head.actor, command_id=cid, seed=seed_of(cid))))
        i = j
    return out


async def record() -> tuple[list[E.Event], list[Decision], ClusterState]:
    with tempfile.TemporaryDirectory(prefix="ndif-rec-") as tmp:
        srv = EmbeddedNats(Path(tmp) / "nats")
        await srv.astart()
        try:
            lg = await fresh_event_log(srv.url)
            sent = await run_scenario(srv.url)
            events: list[E.Event] = [e for _, e in [p async for p in lg.read()] if isinstance(e, E.Event)]
            state = ClusterState()
            async for seq, item in lg.read():
                state.apply(seq, item)
            await lg.close()
        finally:
            srv.close()
    return events, decisions_of(events, sent), state


def main() -> None:
    configure("ERROR")
    events, decisions, state = asyncio.run(record())
    write_history(NAME, [E.encode_event(e) for e in events], decisions, state)
    print(f"{NAME}: {len(events)} events, {len(decisions)} decisions, {state.anomaly_count} anomalies")


if __name__ == "__main__":
    main()
