"""The docs/architecture.md §4 table, row by row, plus the races it names."""

from __future__ import annotations

import pytest

from controlplane.core.projections import ClusterState, check_strict, fold
from schemas import events as E
from schemas.errors import ReplayAnomalyError
from schemas.status import EvictionReason, Level, ModelStatus
from schemas.status import ReplicaState as S
from tests.strategies import CARD, MODELS, _env, node_joined, numbered

M = MODELS[0]
N = "node-a.cluster"
REP = {"model_key": M, "replica_id": 0, "node_id": N}
GB = 2**30


def sched(source=Level.COLD, gpus=(0,), size=10 * GB, rid=0, **kw):
    return E.ReplicaScheduled(**_env("controller"), **{**REP, "replica_id": rid}, gpu_indices=gpus,
                              bytes_per_gpu=size, source=source, **kw)


def ev(cls, rid=0, **kw):
    return cls(**_env("agent"), **{**REP, "replica_id": rid}, **kw)


def evict(target=Level.WARM, drain=False, rid=0):
    return E.ReplicaEvictionRequested(**_env("controller"), **{**REP, "replica_id": rid},
                                      reason=EvictionReason.ADMIN, target=target, drain=drain)


def run(*events):
    return fold(numbered([node_joined(N), *events]), ClusterState())


def rep(state, rid=0):
    return state.replicas[(M, rid)]


def test_happy_path_cold_hot_warm_hot_cold():
    s = run(sched())
    assert rep(s).state is S.LOAD_REQUESTED and s.card_reserved(N, 0) == 10 * GB
    s = run(sched(), ev(E.ReplicaLoading), ev(E.ReplicaLoaded, load_seconds=2.0))
    assert rep(s).state is S.AVAILABLE and rep(s).level is Level.HOT and rep(s).load_seconds == 2.0
    s = run(sched(), ev(E.ReplicaLoading), ev(E.ReplicaLoaded), evict(Level.WARM), ev(E.ReplicaCached, cpu_bytes=10 * GB))
    assert rep(s).state is S.CACHED and rep(s).level is Level.WARM
    assert s.card_reserved(N, 0) == 0 and s.cpu_cached(N) == 10 * GB
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.WARM), ev(E.ReplicaCached, cpu_bytes=10 * GB),
            sched(Level.WARM), ev(E.ReplicaLoaded))
    assert rep(s).state is S.AVAILABLE and s.cpu_cached(N) == 0 and s.card_reserved(N, 0) == 10 * GB
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.WARM), ev(E.ReplicaCached, cpu_bytes=10 * GB),
            evict(Level.COLD), ev(E.ReplicaUnloaded))
    assert rep(s).state is S.UNLOADED and rep(s).level is Level.COLD and s.cpu_cached(N) == 0
    assert s.anomaly_count == 0


def test_drain_then_unload():
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.COLD, drain=True))
    assert rep(s).state is S.DRAINING and s.card_reserved(N, 0) == 10 * GB
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.COLD, drain=True), ev(E.ReplicaDrained))
    assert rep(s).state is S.UNLOAD_REQUESTED
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.COLD, drain=True), ev(E.ReplicaDrained), ev(E.ReplicaUnloaded))
    assert rep(s).state is S.UNLOADED and s.anomaly_count == 0


def test_load_failure_frees_reservation():
    s = run(sched(gpus=(0, 1)), ev(E.ReplicaLoading), ev(E.ReplicaLoadFailed, error="corrupt config.json"))
    assert rep(s).state is S.LOAD_FAILED and rep(s).error == "corrupt config.json"
    assert s.card_reserved(N, 0) == 0 and s.card_reserved(N, 1) == 0
    # ...and it can be scheduled again.
    s = run(sched(), ev(E.ReplicaLoadFailed, error="x"), sched())
    assert rep(s).state is S.LOAD_REQUESTED and s.anomaly_count == 0


def test_restart_and_failure():
    s = run(sched(), ev(E.ReplicaLoaded), ev(E.ReplicaFailed, error="CUDA error"))
    assert rep(s).state is S.FAILED and s.card_reserved(N, 0) == 10 * GB  # held for the restart
    s = run(sched(), ev(E.ReplicaLoaded), ev(E.ReplicaFailed, error="x"),
            E.ReplicaRestartRequested(**_env("controller"), **REP), ev(E.ReplicaRestarted))
    assert rep(s).state is S.AVAILABLE and rep(s).restarts == 1 and s.anomaly_count == 0


def test_race_loaded_after_eviction_requested_keeps_the_eviction():
    s = run(sched(), ev(E.ReplicaLoading), evict(Level.COLD), ev(E.ReplicaLoaded))
    assert rep(s).state is S.UNLOAD_REQUESTED and s.anomaly_count == 0
    s = run(sched(), ev(E.ReplicaLoading), evict(Level.COLD), ev(E.ReplicaLoaded), ev(E.ReplicaUnloaded))
    assert rep(s).state is S.UNLOADED and s.card_reserved(N, 0) == 0


def test_race_restarted_after_eviction_requested_keeps_the_eviction():
    """The same race with a restart (seen on CI: two controllers, restart and evict of one model)."""
    restart = E.ReplicaRestartRequested(**_env("controller"), **REP)
    s = run(sched(), ev(E.ReplicaLoaded), restart, evict(Level.WARM), ev(E.ReplicaRestarted))
    assert rep(s).state is S.UNLOAD_REQUESTED and s.anomaly_count == 0
    s = run(sched(), ev(E.ReplicaLoaded), restart, evict(Level.WARM), ev(E.ReplicaRestarted),
            ev(E.ReplicaCached, cpu_bytes=10 * GB))
    assert rep(s).state is S.CACHED and s.card_reserved(N, 0) == 0 and s.anomaly_count == 0


def test_out_of_order_is_an_anomaly_not_a_crash():
    s = run(ev(E.ReplicaLoaded))  # never scheduled
    assert (M, 0) not in s.replicas and s.anomaly_count == 1
    s = run(sched(), ev(E.ReplicaLoaded), sched())  # double booking refused
    assert s.card_reserved(N, 0) == 10 * GB and s.anomaly_count == 1
    with pytest.raises(ReplayAnomalyError, match="1 anomalies"):
        check_strict(s)


def test_event_from_the_wrong_node_is_refused():
    other = E.ReplicaLoaded(**_env("agent"), model_key=M, replica_id=0, node_id="node-b.cluster")
    s = run(sched(), other)
    assert rep(s).state is S.LOAD_REQUESTED and s.anomaly_count == 1


def test_schedule_on_unknown_node_or_card_is_refused():
    bad = E.ReplicaScheduled(**_env("controller"), model_key=M, replica_id=0, node_id="ghost", gpu_indices=(0,),
                             bytes_per_gpu=1)
    s = run(bad)
    assert (M, 0) not in s.replicas and s.anomaly_count == 1
    s = run(sched(gpus=(7,)))
    assert (M, 0) not in s.replicas and s.anomaly_count == 1


def test_overcommit_is_flagged():
    s = run(sched(size=CARD), sched(rid=1, size=1))
    assert s.card_reserved(N, 0) == CARD + 1 and s.anomaly_count == 1


def test_node_lost_frees_everything_on_it():
    s = run(sched(), ev(E.ReplicaLoaded), sched(rid=1, gpus=(1,)), E.NodeLost(**_env("controller"), node_id=N))
    assert rep(s).state is S.LOST and rep(s, 1).state is S.LOST
    assert s.card_reserved(N, 0) == 0 and not s.nodes[N].alive
    s2 = fold([(99, E.ReplicaEvictionRequested(**_env("controller"), **REP, reason=EvictionReason.NODE_LOST))],
              s)
    assert rep(s2).state is S.UNLOADED


def test_replica_ids_and_counts():
    s = run(sched(rid=0), sched(rid=3, gpus=(1,)), ev(E.ReplicaLoaded, rid=3))
    assert s.models[M].next_replica_id == 4
    assert s.replica_count(M) == 2
    s = run(sched(rid=0), evict(Level.COLD))
    assert s.replica_count(M) == 0


def test_model_status():
    dep = E.DeploymentRequested(**_env("controller"), model_key=M, op="deploy", replicas=1, target_hot=1)
    assert run().model_status(M) is ModelStatus.SCALED_DOWN
    assert run(dep, sched()).model_status(M) is ModelStatus.PROGRESSING
    assert run(dep, sched(), ev(E.ReplicaLoaded)).model_status(M) is ModelStatus.AVAILABLE
    assert run(dep, sched(), ev(E.ReplicaLoadFailed, error="x")).model_status(M) is ModelStatus.FAILED


def test_command_records_span_the_decision():
    a = E.DeploymentRequested(**_env("controller"), model_key=M, op="deploy", replicas=1, target_hot=1,
                              command_id="cmd-1")
    b = E.ReplicaScheduled(**_env("controller"), **REP, gpu_indices=(0,), bytes_per_gpu=1, command_id="cmd-1")
    s = run(a, b)
    rec = s.commands["cmd-1"]
    assert (rec.first_seq, rec.last_seq, rec.events) == (2, 3, 2)


def test_a_warm_replica_whose_copy_is_gone_is_retired_to_cold_not_left_wanting_warm():
    """After a restart no process holds a WARM replica's weights: the agent says so (`cache_lost`),
    and the replica is wanted COLD from then on, out of `status` (an evicted one's place), with
    its history saying why."""
    from controlplane.core.reasons import event_reason
    from controlplane.ops.render import render_status

    lost = ev(E.ReplicaUnloaded, cache_lost=True)
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.WARM), ev(E.ReplicaCached, cpu_bytes=10 * GB), lost)
    assert (rep(s).state, rep(s).level, rep(s).desired) == (S.UNLOADED, Level.COLD, Level.COLD)
    assert s.anomaly_count == 0 and rep(s).cpu_bytes == 0
    assert "retired to COLD" in event_reason(lost)
    assert "(1 replica(s) unloaded and no longer wanted are not listed" in render_status(s)
    # A WARM replica whose move to CPU failed on the way down is retired the same way.
    s = run(sched(), ev(E.ReplicaLoaded), evict(Level.WARM), ev(E.ReplicaFailed, error="oom"))
    assert (rep(s).state, rep(s).desired) == (S.UNLOADED, Level.COLD)
