"""The controller and the `ndif` CLI end to end: real nats-server, controller(s), scripted node agents.

The lifecycle scenario here is the one the real agent's tests re-run (docs/architecture.md §4).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from controlplane.core.projections import replay
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.ops.render import status_json
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas import errors as errs
from schemas.commands import CommandResult
from schemas.events import ReplicaEvictionRequested, ReplicaScheduled
from schemas.keys import canonical_model_key
from schemas.status import EvictionReason
from tests.agent_sim import GB, ScriptedAgent
from tests.integration.cluster import config_only, ndif, settle
from tests.integration.scenario import lifecycle_scenario
from tests.waiting import until_state

pytestmark = pytest.mark.timeout(240)


async def start_all(url: str, *parts: Controller | ScriptedAgent) -> list[Controller | ScriptedAgent]:
    for p in parts:
        await p.start()
    return list(parts)


async def stop_all(parts: list[Controller | ScriptedAgent]) -> None:
    for p in reversed(parts):
        await p.stop()


async def cli_json(url: str, *args: str) -> Any:
    ran = await ndif(url, *args, "--json")
    assert ran.rc == 0, ran.err
    return ran.json() if args[0] in ("status", "replay") else ran.lines()


async def test_lifecycle_through_the_cli(nats_server: EmbeddedNats, admin: AdminClient, tiny: Path) -> None:
    url = nats_server.url
    parts = await start_all(url, Controller.from_url(url, policy_interval_s=0.2),
                            ScriptedAgent(url, "node-a", gpus=2, cpu_cache_bytes=10 * GB))
    try:
        await lifecycle_scenario(url, admin, tiny, node="node-a", drainer="agent:node-a")
    finally:
        await stop_all(parts)


async def test_bad_input_appends_nothing(nats_server: EmbeddedNats, admin: AdminClient, log: JetStreamEventLog,
                                         tiny: Path) -> None:
    url = nats_server.url
    parts = await start_all(url, Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=1))
    try:
        await settle(admin)
        before = await log.last_seq()

        ran = await ndif(url, "deploy", "nobody/not-in-any-cache", "--replicas", "1")
        assert ran.rc == 3 and ran.err.startswith("error: unknown model") and ran.err.count("\n") == 1, ran.err
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "-1")
        assert ran.rc == 2 and "--replicas" in ran.err
        ran = await ndif(url, "restart", str(tiny))
        assert ran.rc == 3 and "never deployed" in ran.err
        ran = await ndif(url, "evict", "--replica-id", "1")
        assert ran.rc == 2
        ran = await ndif(url, "replay", "--until", "yesterday")
        assert ran.rc == 2 and "ISO time" in ran.err
        reply = await log.nc.request("ndif.cmd.deploy", b'{"type": "deploy", "replicas": ', timeout=5)
        bad = msgspec.json.decode(reply.data, type=CommandResult)
        assert not bad.ok and bad.error == "InvalidCommand" and "malformed" in (bad.message or "")
        reply = await log.nc.request("ndif.cmd.deploy", b'{"type": "frobnicate"}', timeout=5)
        assert msgspec.json.decode(reply.data, type=CommandResult).error == "InvalidCommand"
        assert await log.last_seq() == before

        # Deploy once; deploying again is refused with a pointer to scale.
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--command-id", "dup-1", "--json", "--wait")
        assert ran.rc == 0, ran.err
        first = msgspec.json.decode(ran.out.splitlines()[0], type=CommandResult)
        after_first = await log.last_seq()
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1")
        assert ran.rc == 2 and "ndif scale" in ran.err
        ran = await ndif(url, "evict", str(tiny), "--replica-id", "7")
        assert ran.rc == 3 and "no replica 7" in ran.err
        await settle(admin)
        settled_seq = await log.last_seq()
        assert settled_seq == after_first  # the refused deploy and evict appended nothing

        # The same command id again: nothing appended, the first result comes back marked duplicate.
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--command-id", "dup-1", "--json")
        assert ran.rc == 0, ran.err
        again = msgspec.json.decode(ran.out, type=CommandResult)
        assert again.duplicate and (again.first_seq, again.last_seq) == (first.first_seq, first.last_seq)
        assert again.replicas == first.replicas
        # Twins racing (same id, at once, through the queue group) decide once.
        twins = await asyncio.gather(*(admin.scale(str(tiny), 3, command_id="twin-1") for _ in range(4)))
        assert len({(t.first_seq, t.last_seq) for t in twins}) == 1
        assert sum(not t.duplicate for t in twins) <= 1
        events = [e async for _, e in admin.events() if getattr(e, "command_id", None) == "twin-1"]
        assert len(events) == twins[0].last_seq - twins[0].first_seq + 1 == 4  # decided, requested, 2 scheduled
    finally:
        await stop_all(parts)


async def test_no_controller_is_a_clear_error(nats_server: EmbeddedNats, log: JetStreamEventLog,
                                              tiny: Path) -> None:
    before = await log.last_seq()
    ran = await ndif(nats_server.url, "deploy", str(tiny), "--replicas", "1", "--timeout", "2")
    assert ran.rc == 5 and "no controller" in ran.err and "ndif controller" in ran.err
    ran = await ndif("nats://127.0.0.1:1", "status")
    assert ran.rc == 5 and "cannot reach NATS" in ran.err and ran.err.count("\n") == 1
    assert await log.last_seq() == before


async def test_two_controllers_200_concurrent_commands(nats_server: EmbeddedNats, admin: AdminClient,
                                                       log: JetStreamEventLog, tiny: Path,
                                                       tmp_path: Path) -> None:
    url = nats_server.url
    rng = random.Random(7)
    models = [config_only(tmp_path, f"m{i}", tiny) for i in range(10)]
    sizes = {m: rng.choice([8, 20, 35, 60, 110]) * GB for m in models}  # 110 GB spans two cards
    dedicated = set(models[:2])
    c1, c2 = Controller.from_url(url, name="controller:one", min_deploy_s=0.0), Controller.from_url(url, name="controller:two",
                                                                                  min_deploy_s=0.0)
    agents = [ScriptedAgent(url, f"node-{i}", gpus=8, cpu_cache_bytes=150 * GB) for i in range(3)]
    parts = await start_all(url, c1, c2, *agents)
    clients = [await AdminClient.open(url, timeout=60) for _ in range(8)]

    async def one(i: int) -> str:
        m = models[rng.randrange(len(models))]
        a = clients[i % len(clients)]
        verb = rng.choice(["deploy", "scale", "scale_up", "evict", "scale_down", "restart", "evict_one"])
        try:
            match verb:
                case "deploy":
                    await a.deploy(m, rng.randint(1, 3), dedicated=m in dedicated, size_bytes=sizes[m])
                case "scale":
                    await a.scale(m, rng.randint(1, 4))
                case "scale_up":
                    await a.scale(m, rng.randint(1, 2), scale_up=True)
                case "evict":
                    await a.evict(m, cold=rng.random() < 0.3)
                case "evict_one":
                    await a.evict(m, replica_id=rng.randint(0, 3))
                case "scale_down":
                    await a.scale_down(m, rng.randint(0, 2))
                case "restart":
                    await a.restart(m)
            return "ok"
        except (errs.InvalidCommand, errs.NotFound) as exc:  # deploy twice, unknown replica, evict before deploy
            return type(exc).__name__

    try:
        await asyncio.gather(*(clients[0].deploy(m, 1, dedicated=m in dedicated, size_bytes=sizes[m]) for m in models))
        outcomes = await asyncio.gather(*(one(i) for i in range(200)))
        assert outcomes.count("ok") >= 100, outcomes  # the rest: deploy of a deployed model, unknown replica ids
        assert c1.handled > 0 and c2.handled > 0 and c1.handled + c2.handled == 210
        state = await settle(admin, timeout=60)
        assert state.anomaly_count == 0, [(a.seq, a.event_type, a.message, a.replica_id) for a in state.anomalies]
        for node_id in state.nodes:
            for card in state.node_cards(node_id):
                assert card.reserved_bytes <= card.total_bytes and card.committed_bytes <= card.total_bytes
        # No card double-booked at any point: a strict replay of the whole history passes.
        items = [p async for p in log.read()]
        replay(items, strict=True)
        # No dedicated replica was ever evicted by pressure.
        ded = {(e.model_key, e.replica_id) for _, e in items if isinstance(e, ReplicaScheduled) and e.dedicated}
        assert not [e for _, e in items if isinstance(e, ReplicaEvictionRequested)
                    and e.reason is EvictionReason.PRESSURE and (e.model_key, e.replica_id) in ded]
        assert status_json(state)["anomaly_count"] == 0
    finally:
        for a in clients:
            await a.close()
        await stop_all(parts)


async def test_policies_restart_then_replace_then_node_lost(nats_server: EmbeddedNats, admin: AdminClient,
                                                            tiny: Path, tmp_path: Path) -> None:
    url = nats_server.url
    m = config_only(tmp_path, "big", tiny)
    mk = canonical_model_key(m)
    a, b = ScriptedAgent(url, "node-a", gpus=1, heartbeat_s=0.1), ScriptedAgent(url, "node-b", gpus=1, heartbeat_s=0.1)
    ctl = Controller.from_url(url, max_restarts=1, heartbeat_grace_s=1.5, policy_interval_s=0.1)
    parts = await start_all(url, ctl, a, b)
    agents = {"node-a": a, "node-b": b}

    async def until(pred: Any, timeout: float = 10.0) -> Any:
        return await until_state(admin, pred, timeout)

    try:
        res = await admin.deploy(m, 1, size_bytes=50 * GB)
        await admin.wait(res)
        first = res.replicas[0].node_id
        other = "node-b" if first == "node-a" else "node-a"

        await agents[first].fail(mk, 0, "CUDA error: illegal memory access")
        st = await until(lambda s: s.replicas[(mk, 0)].restarts == 1 and s.replicas[(mk, 0)].state == "Available")
        assert st.replicas[(mk, 0)].node_id == first

        await agents[first].fail(mk, 0, "CUDA error again")  # over max_restarts: replaced elsewhere
        st = await until(lambda s: (mk, 1) in s.replicas and s.replicas[(mk, 1)].state == "Available"
                         and s.replicas[(mk, 0)].state == "Unloaded")
        assert st.replicas[(mk, 1)].node_id == other and st.replica_count(mk) == 1

        await agents[other].silence()  # its heartbeat stops: NodeLost, the replica placed on the first node
        st = await until(lambda s: not s.nodes[other].alive and (mk, 2) in s.replicas
                         and s.replicas[(mk, 2)].state == "Available")
        assert st.replicas[(mk, 2)].node_id == first
        assert st.replicas[(mk, 1)].state == "Unloaded" and st.replica_count(mk) == 1
        assert st.anomaly_count == 0, st.anomalies
        assert st.nodes[first].alive  # the node that kept its heartbeat was never declared lost
    finally:
        await stop_all(parts)
