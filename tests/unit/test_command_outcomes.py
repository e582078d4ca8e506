"""What a command decides, in the pure core: recorded no-ops, command-id conflicts, short placements,
restart of a LoadFailed replica, undeploy forgetting a model, and bounds checked at decode."""

from __future__ import annotations

import time

import msgspec
import pytest

from controlplane.core.decide import decide, summarize
from controlplane.core.projections import ClusterState, decode_snapshot, encode_snapshot
from schemas import events as E
from schemas.commands import Deploy, Evict, Limits, Restart, Scale, ScaleDown, Undeploy, decode_command
from schemas.errors import CommandIdConflict, InvalidCommand
from schemas.status import EvictionReason, Level, ModelStatus, ReplicaState
from tests.cluster_builder import GB, Builder, ctx

M = "m"


def apply(b: Builder, events: list[E.Event]) -> int:
    first = b.state.seq + 1
    for e in events:
        b.add(e)
    return first


def test_a_noop_is_recorded_and_its_id_never_serves_another_command() -> None:
    b = Builder().node("n0").hot(M, 0, "n0", (0,), 10).target(M, 1)
    evs = decide(b.state, Scale(command_id="x", model_key=M, replicas=1), ctx("x"))
    assert [type(e) for e in evs] == [E.CommandDecided] and "nothing to do" in evs[0].note
    apply(b, evs)
    assert b.state.commands["x"].fingerprint == evs[0].fingerprint and b.state.commands["x"].verb == "scale"
    assert decide(b.state, Scale(command_id="x", model_key=M, replicas=1), ctx("x")) == []  # the same again
    with pytest.raises(CommandIdConflict, match="already used for a different command"):
        decide(b.state, Scale(command_id="x", model_key=M, replicas=2), ctx("x"))
    with pytest.raises(CommandIdConflict):
        decide(b.state, Evict(command_id="x", model_key=M), ctx("x"))
    assert isinstance(CommandIdConflict("x"), InvalidCommand)  # exit 2


def test_scale_below_points_to_scale_down() -> None:
    b = Builder().node("n0").hot(M, 0, "n0", (0,), 10).hot(M, 1, "n0", (1,), 10).target(M, 2)
    evs = decide(b.state, Scale(command_id="s", model_key=M, replicas=1), ctx("s"))
    res = summarize("s", evs, 10)
    assert res.ok and "ndif scale-down m --replicas 1" in res.message and (res.first_seq, res.last_seq) == (10, 10)


def test_short_placement_is_not_ok_and_counts_what_was_asked() -> None:
    b = Builder().node("n0", gpus=1, gpu_gb=80).model(M, 50)
    evs = decide(b.state, Deploy(command_id="d", model_key=M, replicas=2), ctx("d"))
    res = summarize("d", evs, 5)
    assert not res.ok and (res.asked, res.placed) == (2, 1) and res.error == "PlacementError"
    assert "placed 1 of 2" in res.message
    ok = summarize("d", decide(b.state, Deploy(command_id="e", model_key=M, replicas=1), ctx("e")), 5)
    assert ok.ok and (ok.asked, ok.placed) == (1, 1)


def test_restart_of_a_load_failed_replica_loads_it_again_in_place() -> None:
    b = Builder().node("n0").model(M, 10)
    rep = {"model_key": M, "replica_id": 0, "node_id": "n0"}
    b.add(E.ReplicaScheduled(**b._env(), **rep, gpu_indices=(3,), bytes_per_gpu=11 * GB))
    b.add(E.ReplicaLoadFailed(**b._env("agent"), **rep, error="boom"))
    assert b.state.replicas[(M, 0)].state is ReplicaState.LOAD_FAILED
    evs = decide(b.state, Restart(command_id="r", model_key=M, replica_id=0), ctx("r"))
    sched = [e for e in evs if isinstance(e, E.ReplicaScheduled)]
    assert len(sched) == 1 and (sched[0].replica_id, sched[0].gpu_indices, sched[0].source) == (0, (3,), Level.COLD)
    assert [r.action for r in summarize("r", evs, 1).replicas] == ["restarted"]
    # Evicting it instead goes COLD: it holds nothing to cache.
    ev = decide(b.state, Evict(command_id="v", model_key=M, replica_id=0), ctx("v"))
    assert [e.target for e in ev if isinstance(e, E.ReplicaEvictionRequested)] == [Level.COLD]


def test_undeploy_forgets_the_model_and_its_ids() -> None:
    b = Builder().node("n0", cpu_gb=100).hot(M, 0, "n0", (0,), 10).warm(M, 1, "n0", (1,), 10).target(M, 1)
    evs = decide(b.state, Undeploy(command_id="u", model_key=M), ctx("u"))
    ev_reasons = [(e.replica_id, e.target, e.reason) for e in evs if isinstance(e, E.ReplicaEvictionRequested)]
    assert ev_reasons == [(0, Level.COLD, EvictionReason.UNDEPLOY), (1, Level.COLD, EvictionReason.UNDEPLOY)]
    assert isinstance(evs[-1], E.ModelUndeployed)
    apply(b, evs)
    assert b.state.model_status(M) is ModelStatus.UNDEPLOYING
    with pytest.raises(InvalidCommand, match="being undeployed"):
        decide(b.state, Scale(command_id="s", model_key=M, replicas=1), ctx("s"))
    b.add(E.ReplicaDrained(**b._env("dispatcher"), model_key=M, replica_id=0, node_id="n0"))
    for rid in (0, 1):
        b.add(E.ReplicaUnloaded(**b._env("agent"), model_key=M, replica_id=rid, node_id="n0"))
        mid = b.state
        assert decode_snapshot(encode_snapshot(mid)) == mid  # snapshot + tail = fold holds throughout
    assert M not in b.state.models and not b.state.model_replicas(M) and M in b.state.undeployed
    assert b.state.cpu_cached("n0") == 0 and all(c.reserved_bytes == 0 for c in b.state.node_cards("n0"))
    b.add(E.ReplicaUnloaded(**b._env("agent"), model_key=M, replica_id=0, node_id="n0"))  # a late duplicate
    assert b.state.anomaly_count == 0
    # Deployed again: registered anew, ids start over.
    b.model(M, 10)
    evs = decide(b.state, Scale(command_id="again", model_key=M, replicas=1), ctx("again"))
    assert [e.replica_id for e in evs if isinstance(e, E.ReplicaScheduled)] == [0]


def test_old_histories_have_no_fingerprint_and_stay_duplicates() -> None:
    b = Builder().node("n0").model(M, 10)
    b.add(E.DeploymentRequested(**{**b._env(), "command_id": "old"}, model_key=M, op="scale", replicas=1,
                                target_hot=1))
    assert b.state.commands["old"].fingerprint == ""
    assert decide(b.state, Scale(command_id="old", model_key=M, replicas=5), ctx("old")) == []


@pytest.mark.parametrize("n", [10**9, 2**70, 1000])
def test_counts_above_the_bounds_are_refused_at_decode_in_microseconds(n: int) -> None:
    body = msgspec.json.encode({"verb": "scale", "command_id": "c", "model_key": M, "replicas": n})
    limits = Limits(max_replicas_per_model=128, max_replicas_per_command=64)
    took = []
    for _ in range(5):  # the best of 5 (this machine is shared): refused before any placement runs
        t0 = time.perf_counter()
        with pytest.raises(InvalidCommand, match="limit"):
            decode_command(body, limits)
        took.append(time.perf_counter() - t0)
    assert min(took) < 0.005, took
    with pytest.raises(InvalidCommand):
        Limits.from_env({}, max_replicas_per_model=0)


def test_scale_up_past_the_per_model_bound_is_refused() -> None:
    b = Builder().node("n0").hot(M, 0, "n0", (0,), 10).target(M, 1)
    with pytest.raises(InvalidCommand, match="limit of 2 per model"):
        decide(b.state, Scale(command_id="s", model_key=M, replicas=2, scale_up=True), ctx("s"),
               max_replicas_per_model=2)


def test_cluster_state_keeps_undeployed_in_copies() -> None:
    s = ClusterState()
    s.undeployed.add("x")
    assert s.copy().undeployed == {"x"}


def test_a_model_with_every_replica_evicted_is_scaled_down_not_progressing() -> None:
    from schemas.status import Level, ModelStatus

    b = Builder().node("n0", cpu_gb=100).target(M, 2).warm(M, 0, "n0", (0,), 5).warm(M, 1, "n0", (1,), 5)
    assert all(r.desired is Level.WARM for r in b.state.model_replicas(M))
    assert b.state.model_status(M) is ModelStatus.SCALED_DOWN


def test_a_size_for_an_already_registered_model_is_refused_not_ignored() -> None:
    b = Builder().node("n0").model(M, 10)
    with pytest.raises(InvalidCommand, match=r"registered at 9\.31 GiB.*applies only when a model is registered"):
        decide(b.state, Deploy(command_id="s", model_key=M, replicas=1, size_bytes=10**15), ctx("s"))
    same = decide(b.state, Deploy(command_id="t", model_key=M, replicas=1, size_bytes=10 * 10**9), ctx("t"))
    assert any(type(e).__name__ == "ReplicaScheduled" for e in same)  # the registered size itself: no refusal


def test_a_scale_down_or_restart_with_nothing_to_do_says_why() -> None:
    b = Builder().node("n0").hot(M, 0, "n0", (0,), 10).hot(M, 1, "n0", (1,), 10).target(M, 2)
    up = summarize("d", decide(b.state, ScaleDown(command_id="d", model_key=M, replicas=3), ctx("d")), 10)
    assert up.ok and "has 2 replica(s) wanted HOT, not more than 3" in up.message
    assert "scale-down never scales up: use `ndif scale m --replicas 3`" in up.message
    same = summarize("e", decide(b.state, ScaleDown(command_id="e", model_key=M, replicas=2), ctx("e")), 10)
    assert same.ok and "nothing to do: m has 2 replica(s) wanted HOT, not more than 2" == same.message
    loading = Builder().node("n0").model(M, 10)
    loading.add(E.ReplicaScheduled(**loading._env("controller"), model_key=M, replica_id=0, node_id="n0",
                                   gpu_indices=(0,), bytes_per_gpu=10 * GB))
    res = summarize("r", decide(loading.state, Restart(command_id="r", model_key=M), ctx("r")), 10)
    assert res.ok and "no replica of m is Available, Failed or LoadFailed" in res.message
    assert f"0 {loading.state.replicas[(M, 0)].state}" in res.message


def test_a_second_evict_of_a_warm_model_says_where_it_is_and_what_goes_further() -> None:
    b = Builder().node("n0", cpu_gb=100).target(M, 2).warm(M, 0, "n0", (0,), 5).warm(M, 1, "n0", (1,), 5)
    res = summarize("v", decide(b.state, Evict(command_id="v", model_key=M), ctx("v")), 10)
    assert res.ok and not res.evictions
    assert "nothing to do: m: no replica is wanted HOT (2 WARM in CPU memory, 0 COLD on disk)" in res.message
    assert "`ndif evict --cold`" in res.message, res.message
    cold = summarize("w", decide(b.state, Evict(command_id="w", model_key=M, cold=True), ctx("w")), 10)
    assert len(cold.evictions) == 2 and all(e.level is Level.COLD for e in cold.evictions)


def test_a_count_past_the_limits_names_how_to_raise_them_for_ndif_up_too() -> None:
    body = msgspec.json.encode({"verb": "deploy", "command_id": "c", "model_key": M, "replicas": 1000})
    with pytest.raises(InvalidCommand) as exc:
        decode_command(body, Limits(max_replicas_per_model=128, max_replicas_per_command=64))
    said = str(exc.value)
    assert "NDIF_MAX_REPLICAS_PER_MODEL" in said and "`ndif up`" in said and "--max-replicas-per-model" in said, said
    b = Builder().node("n0").hot(M, 0, "n0", (0,), 10).target(M, 1)
    with pytest.raises(InvalidCommand, match=r"NDIF_MAX_REPLICAS_PER_MODEL.*`ndif up`"):
        decide(b.state, Scale(command_id="s", model_key=M, replicas=2, scale_up=True), ctx("s"), max_replicas_per_model=2)
