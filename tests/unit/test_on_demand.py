"""A deploy a user's request asks for (pure): a right the operator grants, bounded per user and in
all, taking free room only; an operator's deploy or scale of the model makes it the operator's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.core.decide import decide, on_demand_models
from controlplane.core.projections.cluster import ClusterState, Registration
from schemas import events as E
from schemas.commands import Deploy, OnDemand, Scale
from schemas.errors import InvalidCommand, OnDemandRefused
from tests.cluster_builder import GB, Builder, ctx


def reg(name: str) -> Registration:
    return Registration(checkpoint=f"/models/{name}", size_bytes=10 * GB)


def ask(state: ClusterState, name: str, user: str, policy: OnDemand | None = None, n: int = 1) -> list[E.Event]:
    """The dispatcher's deploy of `name` for `user`'s request, applied."""
    cmd = Deploy(command_id=f"d-{name}-{user}-{state.seq}", actor="dispatcher:t", model_key=name, replicas=n,
                 for_request=True, for_user=user)
    events = decide(state, cmd, ctx(cmd.command_id), registration=reg(name), on_demand=policy)
    for e in events:
        state.apply(state.seq + 1, e)
    return events


def test_per_user_and_in_all_each_refused_with_what_to_ask() -> None:
    st_ = Builder().node("n0", gpus=8).state
    policy = OnDemand(per_user=2, total=3)
    ask(st_, "a1", "alice", policy)
    ask(st_, "a2", "alice", policy)
    with pytest.raises(OnDemandRefused, match=r"user 'alice' has 2 model\(s\).*\(limit 2 per user.*ndif deploy a3"):
        ask(st_, "a3", "alice", policy)
    ask(st_, "b1", "bob", policy)  # bob's own share
    with pytest.raises(OnDemandRefused, match=r"3 models are deployed by requests \(limit 3 for all users"):
        ask(st_, "b2", "bob", policy)
    assert sorted(on_demand_models(st_, "alice")) == ["a1", "a2"] and len(on_demand_models(st_)) == 3
    # The operator takes one over: it is no user's share any more.
    for e in decide(st_, Scale(command_id="op", actor="cli:op", model_key="a1", replicas=2), ctx("op")):
        st_.apply(st_.seq + 1, e)
    assert st_.models["a1"].on_demand_for is None and on_demand_models(st_, "alice") == ["a2"]
    ask(st_, "a3", "alice", OnDemand(per_user=2, total=4))


def test_a_right_the_operator_grants() -> None:
    st_ = Builder().node("n0").state
    with pytest.raises(OnDemandRefused, match="may not have models deployed by its requests"):
        ask(st_, "m", "mallory", OnDemand(users=frozenset({"alice"})))
    with pytest.raises(OnDemandRefused):
        ask(st_, "m", "alice", OnDemand(users=frozenset()))  # nobody
    ask(st_, "m", "alice", OnDemand(users=frozenset({"alice"})))
    assert st_.models["m"].on_demand_for == "alice"


def test_an_operators_model_brought_back_by_a_request_is_still_the_operators() -> None:
    b = Builder().node("n0")
    b.model("op-model", 10).target("op-model", 0)
    ask(b.state, "op-model", "alice", OnDemand(per_user=0, total=0))  # no share needed: the operator's
    assert b.state.models["op-model"].on_demand_for is None


def test_a_request_never_evicts_what_the_operator_or_another_user_runs() -> None:
    b = Builder().node("n0", gpus=1, gpu_gb=80)
    b.hot("op-model", 0, "n0", (0,), 70).target("op-model", 1)  # loaded long ago: evictable by the operator
    evs = ask(b.state, "big", "alice")
    assert not any(isinstance(e, E.ReplicaEvictionRequested) for e in evs)
    assert any(isinstance(e, E.PlacementRejected) for e in evs)
    op = decide(b.state, Scale(command_id="op2", actor="cli:op", model_key="big", replicas=1), ctx("op2"))
    assert any(isinstance(e, E.ReplicaEvictionRequested) for e in op)  # the operator's own scale may


@given(st.lists(st.sampled_from(["alice", "bob", "carol"]), max_size=30), st.integers(0, 3), st.integers(0, 6))
def test_no_sequence_of_requests_passes_a_bound(users: list[str], per_user: int, total: int) -> None:
    st_ = Builder().node("n0", gpus=8).state
    policy = OnDemand(per_user=per_user, total=total)
    for i, user in enumerate(users):
        try:
            ask(st_, f"m{i}", user, policy)
        except OnDemandRefused:
            pass
        mine = {u: len(on_demand_models(st_, u)) for u in ("alice", "bob", "carol")}
        assert max(mine.values()) <= per_user and len(on_demand_models(st_)) <= total, mine


def test_the_settings_from_the_environment() -> None:
    assert OnDemand.from_env({}) == OnDemand()
    got = OnDemand.from_env({"NDIF_ON_DEMAND_USERS": "alice, bob", "NDIF_ON_DEMAND_PER_USER": "1",
                             "NDIF_ON_DEMAND_TOTAL": "0"})
    assert got == OnDemand(users=frozenset({"alice", "bob"}), per_user=1, total=0)
    assert OnDemand.from_env({"NDIF_ON_DEMAND_USERS": ""}).users == frozenset()
    with pytest.raises(InvalidCommand, match="between 0"):
        OnDemand.from_env({"NDIF_ON_DEMAND_PER_USER": "-1"})


def test_neither_a_request_bringing_back_the_operators_model_nor_the_autoscaler_of_hers_evicts() -> None:
    from controlplane.core.decide import grow

    b = Builder().node("n0", gpus=1, gpu_gb=80)
    b.hot("running", 0, "n0", (0,), 70).target("running", 1)
    b.model("op-model", 30).target("op-model", 0)
    evs = ask(b.state, "op-model", "alice")
    assert not any(isinstance(e, E.ReplicaEvictionRequested) for e in evs)
    ask(b.state, "hers", "alice")  # waits for room
    assert not any(isinstance(e, E.ReplicaEvictionRequested) for e in grow(b.state, "hers", 2, ctx("as")))
