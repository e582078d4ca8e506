"""An outage is a fact: a controller starting on a log after a gap records it (`ClusterDown`), from
the last heartbeat the server kept to its start; a restart within the grace records nothing.
Real nats-server, a real controller and the scripted agent."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from controlplane.store.heartbeats import last_heard
from schemas.events import ClusterDown
from tests.agent_sim import ScriptedAgent
from tests.conftest import bounded
from tests.integration.cluster import ndif

pytestmark = pytest.mark.timeout(120)


async def _downs(log: JetStreamEventLog) -> list[ClusterDown]:
    return [e async for _, e in log.read(1) if isinstance(e, ClusterDown)]


async def test_a_start_after_a_gap_records_the_outage_and_one_within_the_grace_does_not(
        nats_server: EmbeddedNats, event_log: JetStreamEventLog) -> None:
    url = nats_server.url
    ctl = await Controller.from_url(url, heartbeat_grace_s=2.0).start()
    agent = await ScriptedAgent(url, "node-o", gpus=1).start()
    await asyncio.sleep(0.5)  # a heartbeat or two
    await bounded(agent.stop(), "agent.stop")
    await bounded(ctl.stop(), "controller.stop")
    heard = await last_heard(event_log.nc, api=event_log.api)
    assert heard is not None and (datetime.now(UTC) - heard).total_seconds() < 5, heard
    assert await _downs(event_log) == []  # the first start (an empty log) is no outage

    ctl = await Controller.from_url(url, heartbeat_grace_s=2.0).start()  # at once: within the grace
    await bounded(ctl.stop(), "controller.stop")
    assert await _downs(event_log) == []

    await asyncio.sleep(3.0)  # nothing heard for longer than the grace
    before = datetime.now(UTC)
    ctl = await Controller.from_url(url, heartbeat_grace_s=2.0).start()
    try:
        (down,) = await _downs(event_log)
        assert down.down_from >= heard and down.up_at >= before and down.down_s >= 3.0, down
        assert ctl.state.outages and ctl.state.outages[-1].down_from == down.down_from
    finally:
        await bounded(ctl.stop(), "controller.stop")
    # The record itself is the log's newest time: a start soon after it (within a longer grace) adds none.
    ctl = await Controller.from_url(url, heartbeat_grace_s=30.0).start()
    await bounded(ctl.stop(), "controller.stop")
    assert len(await _downs(event_log)) == 1


async def test_a_models_history_shows_the_outage_it_lived_through(nats_server: EmbeddedNats, event_log: JetStreamEventLog,
                                                                  tmp_path) -> None:
    url = nats_server.url
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2"}')
    ctl = await Controller.from_url(url, heartbeat_grace_s=1.0).start()
    admin = await AdminClient.open(url, timeout=30)
    try:
        await admin.deploy(str(tmp_path / "m"), 1, size_bytes=10**6)  # registered; no node to place it on
    finally:
        await admin.close()
        await bounded(ctl.stop(), "controller.stop")
    await asyncio.sleep(2.0)  # nothing heard for longer than the grace
    ctl = await Controller.from_url(url, heartbeat_grace_s=1.0).start()
    try:
        ran = await ndif(url, "history", str(tmp_path / "m"))
        assert ran.rc == 0, ran
        lines = ran.out.splitlines()
        assert "ClusterDown" in lines[-1] and "cluster down" in lines[-1], ran.out
    finally:
        await bounded(ctl.stop(), "controller.stop")
