"""A model's restart is rolling: one replica at a time, each after the previous is Available again,
so the model keeps serving; `rolling=False` (the CLI's --all-at-once) restarts every one at once."""

from __future__ import annotations

import hashlib

import msgspec

from controlplane.core.decide import decide, decide_rollout
from schemas import events as E
from schemas.commands import Restart, fingerprint
from schemas.status import ReplicaState as S
from tests.cluster_builder import Builder, ctx

M, N = "m", "n0"


def three_serving() -> Builder:
    b = Builder().node(N, gpus=4)
    for rid in range(3):
        b.hot(M, rid, N, (rid,), 5)
    return b


def apply(b: Builder, events: list[E.Event]) -> None:
    for e in events:
        b.add(e)


def restarted(events: list[E.Event]) -> list[int]:
    return [e.replica_id for e in events if isinstance(e, E.ReplicaRestartRequested)]


def back(b: Builder, rid: int) -> None:
    b.add(E.ReplicaRestarted(**b._env("agent"), model_key=M, replica_id=rid, node_id=N))


def test_one_replica_at_a_time_each_after_the_previous_is_available_again():
    b = three_serving()
    first = decide(b.state, Restart(command_id="r1", model_key=M, rolling=True), ctx("r1"))
    assert restarted(first) == [0]
    (ro,) = [e for e in first if isinstance(e, E.RolloutUpdated)]
    assert ro.remaining == (1, 2) and ro.current == 0
    apply(b, first)
    assert [r.state for r in b.state.model_replicas(M)].count(S.AVAILABLE) == 2
    assert decide_rollout(b.state, M, ctx("p1")) == []  # replica 0 still restarting: nothing yet
    back(b, 0)
    step = decide_rollout(b.state, M, ctx("p2"))
    assert restarted(step) == [1]
    apply(b, step)
    back(b, 1)
    step = decide_rollout(b.state, M, ctx("p3"))
    assert restarted(step) == [2] and step[-1].remaining == ()
    apply(b, step)
    back(b, 2)
    assert decide_rollout(b.state, M, ctx("p4")) == []
    assert b.state.models[M].rollout == () and b.state.anomaly_count == 0
    assert all(r.restarts == 1 and r.state is S.AVAILABLE for r in b.state.model_replicas(M))


def test_a_replica_that_fails_its_restart_stops_the_rollout_and_says_why():
    b = three_serving()
    apply(b, decide(b.state, Restart(command_id="r1", model_key=M, rolling=True), ctx("r1")))
    b.add(E.ReplicaFailed(**b._env("agent"), model_key=M, replica_id=0, node_id=N, error="CUDA error"))
    (stop,) = decide_rollout(b.state, M, ctx("p1"))
    assert isinstance(stop, E.RolloutUpdated) and stop.remaining == ()
    assert "replica 0 is Failed" in stop.note and "1, 2 not restarted" in stop.note
    apply(b, [stop])
    assert b.state.models[M].rollout == ()


def test_a_replica_that_left_meanwhile_is_skipped_with_a_note():
    b = three_serving()
    apply(b, decide(b.state, Restart(command_id="r1", model_key=M, rolling=True), ctx("r1")))
    back(b, 0)
    b.add(E.ReplicaEvictionRequested(**b._env("controller"), model_key=M, replica_id=1, node_id=N,
                                     reason="admin", target="WARM"))
    step = decide_rollout(b.state, M, ctx("p1"))
    assert restarted(step) == [2] and "skipped replica(s) 1" in step[-1].note


def test_all_at_once_restarts_every_replica_in_one_decision():
    b = three_serving()
    evs = decide(b.state, Restart(command_id="r1", model_key=M), ctx("r1"))
    assert restarted(evs) == [0, 1, 2] and not [e for e in evs if isinstance(e, E.RolloutUpdated)]


def test_a_restart_recorded_before_rolling_existed_keeps_its_fingerprint():
    cmd = Restart(command_id="c", actor="a", model_key=M)
    legacy = msgspec.json.encode({"verb": "restart", "command_id": "", "actor": "", "model_key": M,
                                  "replica_id": None})
    assert fingerprint(cmd) == hashlib.blake2b(legacy, digest_size=12).hexdigest()
    assert fingerprint(msgspec.structs.replace(cmd, rolling=True)) != fingerprint(cmd)


def test_a_failed_replica_is_not_hot_while_its_restart_is_under_way():
    """Observed level: a replica whose process died holds its cards' reservation, not its weights,
    until its restart completes (`ndif status` said HOT there, a new user found)."""
    from schemas.status import Level

    b = three_serving()
    b.add(E.ReplicaFailed(**b._env("agent"), model_key=M, replica_id=0, node_id=N, error="actor not found"))
    assert b.state.replicas[(M, 0)].level is Level.COLD
    b.add(E.ReplicaRestartRequested(**b._env("controller"), model_key=M, replica_id=0, node_id=N, command_id="c1"))
    r = b.state.replicas[(M, 0)]
    assert r.state is S.RESTARTING and r.level is Level.COLD and r.desired is Level.HOT
    back(b, 0)
    assert b.state.replicas[(M, 0)].level is Level.HOT
    b.add(E.ReplicaRestartRequested(**b._env("controller"), model_key=M, replica_id=1, node_id=N, command_id="c2"))
    assert b.state.replicas[(M, 1)].level is Level.HOT  # a running replica's restart: on GPU until reloaded
