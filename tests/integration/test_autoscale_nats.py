"""Autoscaling on a real nats-server: `ndif autoscale`, queue figures on `ndif.figures.<mtok>` (published
here as a dispatcher publishes them), a real controller and a scripted node agent. A burst scales up,
its end scales down, `ndif history` says why, and a manual count is respected."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from schemas import events as E
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState
from tests.agent_sim import ScriptedAgent
from tests.integration.cluster import Publisher, ndif
from tests.waiting import until_state

pytestmark = pytest.mark.timeout(180)


async def test_burst_up_end_down_history_says_why_and_a_manual_count_stands(
        nats_server: EmbeddedNats, admin: AdminClient, tiny: Path) -> None:
    url = nats_server.url
    ctl = Controller.from_url(url, autoscale_interval_s=0.1)
    agent = ScriptedAgent(url, "node-a", gpus=8)
    await ctl.start()
    await agent.start()
    try:
        res = await admin.deploy(str(tiny), 1)
        await admin.wait(res)
        mk = canonical_model_key(str(tiny))
        ran = await ndif(url, "autoscale", str(tiny), "--min", "1", "--max", "4", "--target-queue-per-replica", "4",
                         "--upscale-delay", "0.5s", "--downscale-delay", "1s", "--idle-after", "1h")
        assert ran.rc == 0 and "autoscaling on: 1..4 replicas" in ran.out, ran.err
        ran = await ndif(url, "autoscale", str(tiny), "--min", "5", "--max", "2")
        assert ran.rc == 2 and "--min (5) is above --max (2)" in ran.err

        with Publisher(admin, mk) as pub:
            pub.load = (37, 2)  # a burst: 39 for 1 replica at 4 each -> 10, capped at 4
            st = await until_state(admin, lambda s: s.replica_count(mk) == 4 and all(
                r.state is ReplicaState.AVAILABLE for r in s.model_replicas(mk) if r.desired.value == "HOT"), 30)
            pub.load = (0, 2)  # the burst ends: 2 running fit one replica
            st = await until_state(admin, lambda s: s.replica_count(mk) == 1, 30)
            decided = [e for _, e in [p async for p in admin.events(model=mk)] if isinstance(e, E.AutoscaleDecided)]
            scaled = [(e.current, e.target, e.rule) for e in decided if e.target != e.current]
            assert scaled == [(1, 4, "queue-above-target"), (4, 1, "queue-below-target")], scaled

            ran = await ndif(url, "history", str(tiny))
            assert ran.rc == 0 and "scaled 1 -> 4: 37 queued, 2 running, 1 replicas, target 4 per replica, above for" \
                in ran.out, ran.out
            assert "scaled 4 -> 1 (queue-below-target, to WARM): 0 queued, 2 running, 4 replicas" in ran.out

            ran = await ndif(url, "scale", str(tiny), "--replicas", "3")
            assert ran.rc == 0, ran.err
            pub.load = (40, 0)
            await asyncio.sleep(2.0)  # several ticks, the queue far above target
            st = await admin.state()
            assert st.replica_count(mk) == 3 and st.models[mk].autoscale_manual
            ran = await ndif(url, "status", "--json")
            model = next(m for m in ran.json()["models"] if m["model_key"] == mk)
            assert model["autoscale_manual"] and model["autoscale"]["max_replicas"] == 4

            ran = await ndif(url, "autoscale", str(tiny), "--off")
            assert ran.rc == 0 and "autoscaling off" in ran.out
            assert (await admin.state()).models[mk].autoscale is None
    finally:
        with contextlib.suppress(Exception):
            await agent.stop()
        await ctl.stop()
