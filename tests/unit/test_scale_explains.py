"""`ndif deploy` / `ndif scale` say where each replica went and why, read off the decision's own
events and the cluster before them (controlplane/ops/render.py `explain_decision`)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from controlplane.core.projections import ClusterState
from controlplane.ops.cli import _print_result
from controlplane.ops.render import explain_decision
from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.commands import Deploy, Evict, Scale
from schemas.keys import canonical_model_key, display_name

GB = 10**9


def _joined(node_id: str, gpus: int) -> E.NodeJoined:
    return E.NodeJoined(event_id=f"join-{node_id}", ts=datetime.now(UTC), actor=f"agent:{node_id}", node_id=node_id,
                        cpu_cache_bytes=100 * GB,
                        gpus=tuple(E.GpuInfo(index=i, memory_bytes=80 * GB) for i in range(gpus)))


def _model(tmp_path, name: str) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text("{}")
    return canonical_model_key(str(tmp_path / name), relative=False)


async def _decide(ctl: Controller, log: MemoryEventLog, cmd: object, verb: str):
    res = await ctl.handle(msgspec.json.encode(cmd), verb=verb)
    assert res.ok, res
    stored = list(enumerate(log.events(), 1))
    before = ClusterState()
    for seq, e in stored[:res.first_seq - 1]:
        before.apply(seq, e)
    return res, explain_decision(before, stored[res.first_seq - 1:res.last_seq])


async def test_each_placed_replica_says_its_fit_and_spread_and_a_warm_reuse_says_so(tmp_path, capsys) -> None:
    log = MemoryEventLog()
    await log.append([_joined("node-a", 2)], expected_last_seq=0)
    mk = _model(tmp_path, "m")
    async with Controller(Parts(log, None), policy_interval_s=60) as ctl:
        res, why = await _decide(ctl, log, Deploy(command_id="d", model_key=mk, replicas=3, size_bytes=GB), "deploy")
        assert len(why) == 3 and all("fit: needs" in w and "spread:" in w for w in why.values()), why
        third = why[(mk, 2)]
        assert "2 other replica(s) of the model on node-a" in third, third
        assert "(card 0: 1, card 1: 1)" in third, third  # the first two spread over both cards
        _print_result("deploy", res, False, why)
        out = capsys.readouterr().out
        assert f"replica 2 of {display_name(mk)}: scheduled on node-a" in out and "      why: fit: needs" in out

        # Evicted to WARM, then scaled back: the WARM copy is reused, and the reason says so.
        await ctl.handle(msgspec.json.encode(Evict(command_id="e", model_key=mk, replica_id=2)), verb="evict")
        cached = E.ReplicaCached(event_id="c", ts=datetime.now(UTC), actor="agent:node-a", model_key=mk,
                                 replica_id=2, node_id="node-a", cpu_bytes=GB)
        await log.append([cached], expected_last_seq=None)
        res, why = await _decide(ctl, log, Scale(command_id="s", model_key=mk, replicas=3), "scale")
        assert list(why) == [(mk, 2)] and why[(mk, 2)].startswith("WARM reuse: its weights were in node-a's"), why


async def test_a_replica_placed_after_evicting_another_names_its_victim(tmp_path) -> None:
    log = MemoryEventLog()
    await log.append([_joined("node-a", 1)], expected_last_seq=0)
    small, big = _model(tmp_path, "small"), _model(tmp_path, "big")
    async with Controller(Parts(log, None), policy_interval_s=60, min_deploy_s=0.0) as ctl:
        await _decide(ctl, log, Deploy(command_id="d1", model_key=small, size_bytes=40 * GB), "deploy")
        loaded = E.ReplicaLoaded(event_id="l", ts=datetime.now(UTC), actor="agent:node-a", model_key=small,
                                 replica_id=0, node_id="node-a")
        await log.append([loaded], expected_last_seq=None)
        _, why = await _decide(ctl, log, Deploy(command_id="d2", model_key=big, size_bytes=40 * GB), "deploy")
        assert f"room made by evicting {display_name(small)}#0 (pressure" in why[(big, 0)], why
