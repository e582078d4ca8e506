"""The controller's autoscaler over the in-memory log (no NATS, no Ray): figures summed over
dispatchers, stale ones forgotten, decisions appended by its tick, two controllers deciding once,
a restarted controller going on from the log, a manual count left alone."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import msgspec

from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.autoscale import FIGURES_STALE_S, AutoscalePolicy, QueueFigures
from schemas.commands import Autoscale, Deploy, Scale
from schemas.keys import canonical_model_key
from tests.waiting import until

GB = 10**9
POLICY = AutoscalePolicy(min_replicas=1, max_replicas=6, target_queue_per_replica=4, upscale_delay_s=0,
                         downscale_delay_s=0, idle_after_s=3600, max_wait_s=None)


def _joined(node_id: str, gpus: int) -> E.NodeJoined:
    return E.NodeJoined(event_id=f"join-{node_id}", ts=datetime.now(UTC), actor=f"agent:{node_id}", node_id=node_id,
                        cpu_cache_bytes=0, gpus=tuple(E.GpuInfo(index=i, memory_bytes=80 * GB) for i in range(gpus)))


async def _deployed(tmp_path, log: MemoryEventLog, ctl: Controller, policy: AutoscalePolicy = POLICY) -> str:
    (tmp_path / "config.json").write_text("{}")
    mk = canonical_model_key(str(tmp_path), relative=False)
    res = await ctl.handle(msgspec.json.encode(Deploy(command_id="d", model_key=mk, size_bytes=GB)), verb="deploy")
    assert res.ok, res
    res = await ctl.handle(msgspec.json.encode(Autoscale(command_id="a", model_key=mk, policy=policy)),
                           verb="autoscale")
    assert res.ok and res.message.startswith("autoscaling on: ") and res.last_seq, res
    return mk


def fig(mk: str, dispatcher: str, queued: int, running: int = 0) -> QueueFigures:
    return QueueFigures(model_key=mk, queued=queued, running=running, dispatcher=dispatcher)


async def test_figures_of_several_dispatchers_are_summed_and_stale_ones_dropped(tmp_path):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 8)], expected_last_seq=0)
    async with Controller(Parts(log, None), name="controller:a", autoscale_interval_s=3600) as ctl:
        mk = await _deployed(tmp_path, log, ctl)
        ctl.observe_figures(fig(mk, "d1", 6, 1), heard_at=100.0)
        ctl.observe_figures(fig(mk, "d2", 5, 1), heard_at=100.0 + FIGURES_STALE_S)
        both = ctl.figures_of(mk, now=100.0 + FIGURES_STALE_S)
        assert both is not None and (both.queued, both.running, both.dispatchers) == (11, 2, 2)
        one = ctl.figures_of(mk, now=100.0 + FIGURES_STALE_S + 0.5)
        assert one is not None and (one.queued, one.dispatchers) == (5, 1)
        assert ctl.figures_of(mk, now=1e9) is None


async def test_the_tick_scales_up_on_figures_and_two_controllers_decide_once(tmp_path):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 8)], expected_last_seq=0)
    async with Controller(Parts(log, None), name="controller:a", autoscale_interval_s=3600) as a, \
            Controller(Parts(log, None), name="controller:b", autoscale_interval_s=3600) as b:
        mk = await _deployed(tmp_path, log, a)
        await until(lambda: b.state.seq == a.state.seq)
        for ctl in (a, b):
            ctl.observe_figures(fig(mk, "d1", 15, 1))
        got = await asyncio.gather(a.autoscale(mk), b.autoscale(mk))
        heads = [e for e in log.events() if isinstance(e, E.AutoscaleDecided)]
        assert len(heads) == 1 and (heads[0].current, heads[0].target) == (1, 4), (heads, got)
        assert heads[0].figures is not None and heads[0].figures.queued == 15
        await until(lambda: b.state.seq == a.state.seq)
        assert a.state.replica_count(mk) == b.state.replica_count(mk) == 4
        assert await a.autoscale(mk) == [] and await b.autoscale(mk) == []  # steady: nothing more


async def test_no_figures_after_a_restart_no_decision_and_the_log_carries_on(tmp_path):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 8)], expected_last_seq=0)
    slow = msgspec.structs.replace(POLICY, downscale_delay_s=3600)
    async with Controller(Parts(log, None), name="controller:a", autoscale_interval_s=3600) as a:
        mk = await _deployed(tmp_path, log, a, slow)
        await a.handle(msgspec.json.encode(Autoscale(command_id="a2", model_key=mk,
                                                     policy=msgspec.structs.replace(slow, min_replicas=3))),
                       verb="autoscale")
        a.observe_figures(fig(mk, "d1", 0, 1))
        assert (await a.autoscale(mk))[0].rule == "min"
        await a.handle(msgspec.json.encode(Autoscale(command_id="a3", model_key=mk, policy=slow)), verb="autoscale")
        watch = await a.autoscale(mk)  # the load fits one replica: a scale-down condition starts
        assert [(e.rule, e.condition) for e in watch] == [("watch", "down")]
    async with Controller(Parts(log, None), name="controller:b", autoscale_interval_s=3600) as b:
        m = b.state.models[mk]
        assert m.autoscale_condition == "down" and m.autoscale_since == watch[0].since  # from the log
        assert await b.autoscale(mk) == []  # no figures heard yet: nothing, never a scale-down
        assert b.state.replica_count(mk) == 3


async def test_a_manual_scale_is_left_alone_by_the_tick(tmp_path):
    log = MemoryEventLog()
    await log.append([_joined("node-a", 8)], expected_last_seq=0)
    async with Controller(Parts(log, None), name="controller:a", autoscale_interval_s=0.02) as a:
        mk = await _deployed(tmp_path, log, a)
        res = await a.handle(msgspec.json.encode(Scale(command_id="s", model_key=mk, replicas=5)), verb="scale")
        assert res.ok and a.state.models[mk].autoscale_manual
        a.observe_figures(fig(mk, "d1", 0, 0))
        await asyncio.sleep(0.2)
        assert a.state.replica_count(mk) == 5 and a.autoscale_decisions == 0
        await a.handle(msgspec.json.encode(Autoscale(command_id="a2", model_key=mk, policy=POLICY)),
                       verb="autoscale")
        a.observe_figures(fig(mk, "d1", 0, 1))
        await until(lambda: a.state.replica_count(mk) == 1)
        head = [e for e in log.events() if isinstance(e, E.AutoscaleDecided) and e.target != e.current][-1]
        assert (head.current, head.target, head.rule) == (5, 1, "queue-below-target")
