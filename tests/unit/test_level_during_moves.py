"""A replica's level is where its weights are at every seq: a WARM replica brought back reads WARM
(and its host's CPU cache holds its bytes) until its load completes, not COLD from the moment it is
scheduled."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from controlplane.core.projections import ClusterState
from schemas import events as E
from schemas.status import Level
from schemas.status import ReplicaState as S
from tests.cluster_builder import GB, Builder
from tests.strategies import histories, numbered

N, M = "n0", "m"
REP = {"model_key": M, "replica_id": 0, "node_id": N}


def test_a_warm_replica_reads_warm_and_keeps_its_cache_bytes_until_loaded():
    b = Builder().node(N, gpus=1, cpu_gb=100).warm(M, 0, N, (0,), 10)
    assert b.state.replicas[(M, 0)].level is Level.WARM and b.state.cpu_cached(N) == 10 * GB
    b.add(E.ReplicaScheduled(**b._env("controller"), **REP, gpu_indices=(0,), bytes_per_gpu=10 * GB,
                             source=Level.WARM))
    b.add(E.ReplicaLoading(**b._env("agent"), **REP))
    r = b.state.replicas[(M, 0)]
    assert r.state is S.LOADING and r.level is Level.WARM
    assert b.state.cpu_cached(N) == 10 * GB  # the weights are still in the host's cache
    b.add(E.ReplicaLoaded(**b._env("agent"), **REP, load_seconds=0.2))
    r = b.state.replicas[(M, 0)]
    assert r.level is Level.HOT and b.state.cpu_cached(N) == 0 and b.state.anomaly_count == 0


def test_a_cold_load_reads_cold_until_loaded():
    b = Builder().node(N, gpus=1).model(M, 10)
    b.add(E.ReplicaScheduled(**b._env("controller"), **REP, gpu_indices=(0,), bytes_per_gpu=10 * GB))
    assert b.state.replicas[(M, 0)].level is Level.COLD


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_at_every_seq_level_follows_the_weights_and_each_cache_counts_exactly_its_replicas(events):
    state = ClusterState()
    for seq, e in numbered(events):
        state.apply(seq, e)
        held: dict[str, int] = {}
        for r in state.replicas.values():
            if r.cpu_bytes:
                held[r.node_id] = held.get(r.node_id, 0) + r.cpu_bytes
            assert (r.level is Level.WARM) == (r.cpu_bytes > 0 and r.level is not Level.HOT)
            if r.level is Level.HOT:
                assert r.on_gpu and r.cpu_bytes == 0
        for node in state.nodes:
            assert state.cpu_cached(node) == held.get(node, 0)
