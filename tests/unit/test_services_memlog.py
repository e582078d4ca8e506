"""The controller as a service over the in-memory log: given its parts, not a URL (no NATS, no Ray).

It folds what is appended, decides a command body into events, replays an already-decided one from
the log, and its failure policy follows the log by itself.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import msgspec
import pytest

from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.commands import Deploy, Restart
from schemas.errors import InfrastructureError, InvalidCommand
from schemas.keys import canonical_model_key
from tests.waiting import until

GB = 10**9


def _joined(node_id: str, gpus: int) -> E.NodeJoined:
    return E.NodeJoined(event_id=f"join-{node_id}", ts=datetime.now(UTC), actor=f"agent:{node_id}", node_id=node_id,
                        cpu_cache_bytes=0, gpus=tuple(E.GpuInfo(index=i, memory_bytes=80 * GB) for i in range(gpus)))


@pytest.fixture
def checkpoint(tmp_path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return canonical_model_key(str(tmp_path), relative=False)


async def test_the_controller_decides_over_the_memory_log_with_its_own_settings(checkpoint):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 2)], expected_last_seq=0)
    async with Controller(Parts(log, None), name="controller:unit", min_deploy_s=12.0, headroom=0.4,
                          policy_interval_s=0.05) as ctl:
        assert ctl.state.seq == 1  # folded on start
        body = msgspec.json.encode(Deploy(command_id="d-1", model_key=checkpoint, size_bytes=10 * GB))
        res = await ctl.handle(body, verb="deploy")
        assert res.ok, res
        scheduled = [e for e in log.events() if isinstance(e, E.ReplicaScheduled)]
        assert len(scheduled) == 1 and scheduled[0].command_id == "d-1"  # the actor: the command's sender
        # The settings it was given are the ones decided with, and recorded for replay.
        assert (scheduled[0].min_deploy_s, scheduled[0].headroom) == (12.0, 0.4)
        assert scheduled[0].bytes_per_gpu * len(scheduled[0].gpu_indices) >= 14 * GB
        # The same command again is answered from the log, and appends nothing.
        n = await log.last_seq()
        again = await ctl.handle(body, verb="deploy")
        assert again.duplicate and again.ok and await log.last_seq() == n
        # A refusal is typed and appends nothing either.
        bad = await ctl.handle(b'{"command_id": "x", "replicas": -1}', verb="deploy")
        assert not bad.ok and bad.error and await log.last_seq() == n


async def test_its_failure_policy_follows_the_memory_log(checkpoint):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 1)], expected_last_seq=0)
    async with Controller(Parts(log, None), policy_interval_s=0.05, max_restarts=2) as ctl:
        res = await ctl.handle(msgspec.json.encode(Deploy(command_id="d", model_key=checkpoint, size_bytes=GB)))
        assert res.ok, res
        (s,) = [e for e in log.events() if isinstance(e, E.ReplicaScheduled)]
        rep = {"model_key": s.model_key, "replica_id": s.replica_id, "node_id": s.node_id}
        now = datetime.now(UTC)
        await log.append([E.ReplicaLoaded(event_id="l", ts=now, actor="agent:node-a", **rep),
                          E.ReplicaFailed(event_id="f", ts=now, actor="agent:node-a", error="boom", **rep)],
                         expected_last_seq=await log.last_seq())
        await until(lambda: any(isinstance(e, E.ReplicaRestartRequested) for e in log.events()))
        (restart,) = [e for e in log.events() if isinstance(e, E.ReplicaRestartRequested)]
        assert restart.replica_id == s.replica_id and restart.attempt == 1
        await until(lambda: ctl.state.seq == len(log.events()))
        # No NATS, so no heartbeats watched: the node is not declared lost for being silent.
        await asyncio.sleep(0.2)
        assert not any(isinstance(e, E.NodeLost) for e in log.events())


async def test_the_dashboard_serves_the_memory_log_and_says_the_queues_are_unknown():
    import aiohttp

    from controlplane.dashboard.server import Dashboard

    log = MemoryEventLog()
    await log.append([_joined("node-a", 2)], expected_last_seq=0)
    async with Dashboard(Parts(log, None), port=0, queue_poll_s=0.05) as dash, \
            aiohttp.ClientSession(headers=dash.auth_headers()) as http:
        async with http.get(dash.base_url + "api/state") as r:
            body = await r.json()
        assert body["last_seq"] == 1 and [n["node_id"] for n in body["nodes"]] == ["node-a"]
        await log.append([_joined("node-b", 1)], expected_last_seq=1)  # followed live
        await until(lambda: dash.model.seq == 2)
        await until(lambda: dash.queues.get("asked_at") is not None)
        async with http.get(dash.base_url + "api/queues") as r:
            queues = await r.json()
        assert queues["dispatcher"] is None and "no NATS connection" in queues["error"]


class _Unreadable(MemoryEventLog):
    async def read_batches(self, *a, **kw):  # type: ignore[override]
        raise InfrastructureError("stream unreachable")
        yield []  # pragma: no cover - an async generator


async def test_a_failed_start_closes_what_the_service_opened():
    from controlplane.dashboard.server import Dashboard
    from dataplane.serving.dispatcher import Dispatcher

    closed: list[str] = []

    def parts(log: MemoryEventLog, who: str) -> Parts:
        async def close() -> None:
            closed.append(who)
        return Parts(log, None, close)

    with pytest.raises(InfrastructureError):
        await Controller(parts(_Unreadable(), "controller")).start()
    with pytest.raises(InfrastructureError):
        await Dashboard(parts(_Unreadable(), "dashboard"), port=0).start()
    with pytest.raises(InvalidCommand, match="NATS connection"):  # no NATS: it cannot serve requests
        await Dispatcher(parts(MemoryEventLog(), "dispatcher")).start()
    assert closed == ["controller", "dashboard", "dispatcher"]


async def test_a_url_where_parts_belong_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"Controller.from_url"):
        await Controller("nats://127.0.0.1:4222").start()  # type: ignore[arg-type]


async def test_a_restart_in_place_names_the_cards_it_keeps(checkpoint):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 2)], expected_last_seq=0)
    async with Controller(Parts(log, None), policy_interval_s=60) as ctl:
        assert (await ctl.handle(msgspec.json.encode(Deploy(command_id="d", model_key=checkpoint,
                                                             size_bytes=GB)))).ok
        (s,) = [e for e in log.events() if isinstance(e, E.ReplicaScheduled)]
        await log.append([E.ReplicaLoaded(event_id="l", ts=datetime.now(UTC), actor="agent:node-a",
                                          model_key=s.model_key, replica_id=s.replica_id, node_id=s.node_id)],
                         expected_last_seq=await log.last_seq())
        await until(lambda: ctl.state.seq == len(log.events()))
        res = await ctl.handle(msgspec.json.encode(Restart(command_id="r", model_key=checkpoint,
                                                           replica_id=s.replica_id)))
        assert res.ok, res
        (r,) = res.replicas
        assert r.action == "restarted" and r.node_id == "node-a" and r.gpu_indices == tuple(s.gpu_indices)
