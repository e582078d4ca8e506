"""The rules at the boundary and the level-triggered placement of lost replicas.

- Repo ids: ours refuses exactly what huggingface_hub's `validate_repo_id` refuses (checked against the
  installed library), at the schema, as InvalidCommand (so a bad id never reaches the controller's registry).
- Commands: the verb of the subject must be the body's; command ids and actors are bounded tokens.
- `decide_unplaced`: replicas wanted HOT whose node was lost are placed again once room exists, never
  by pushing a running replica out; pure, deterministic, and idempotent once applied.
"""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest
from huggingface_hub.utils import HFValidationError, validate_repo_id
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controlplane.core.decide import decide_node_lost, decide_unplaced
from schemas import events as E
from schemas.commands import Deploy, Evict, Scale, decode_command
from schemas.errors import InvalidCommand
from schemas.keys import canonical_model_key, check_repo_id
from schemas.status import EvictionReason, Level, ReplicaState
from tests.cluster_builder import GB, T0, Builder, ctx

S = ReplicaState

BAD_REPO_IDS = ["a" * 97, "org/" + "b" * 97, "a--b", "c..d", "x/y/z", ".x", "x.", "-x", "x-", "foo.git", "a b",
                "caf\u00e9", "org/-x", ""]
GOOD_REPO_IDS = ["gpt2", "openai-community/gpt2", "a" * 96, "org/" + "b" * 96, "Foo-BAR_foo.bar123", "_x_", "1"]


def _hf_ok(repo_id: str) -> bool:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


@pytest.mark.parametrize("bad", BAD_REPO_IDS)
def test_repo_ids_hf_refuses_are_invalid_commands(bad):
    assert not _hf_ok(bad) or bad == ""
    with pytest.raises(InvalidCommand, match=r"repo id|model key"):
        canonical_model_key(bad if bad else "x--")
    with pytest.raises(InvalidCommand):
        repo = msgspec.json.encode(bad or "a..b").decode()
        canonical_model_key('nnsight.modeling.language.LanguageModel:{"repo_id": ' + repo + "}")


@pytest.mark.parametrize("good", GOOD_REPO_IDS)
def test_repo_ids_hf_accepts_are_kept(good):
    assert _hf_ok(good)
    assert check_repo_id(good) == good
    assert f'"repo_id": "{good}"' in canonical_model_key(good)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab9_-./", max_size=12) | st.text(alphabet="a-.", min_size=90, max_size=100)
       | st.text(max_size=20))
def test_repo_id_rule_is_huggingface_hubs(text):
    try:
        check_repo_id(text)
        ours = True
    except InvalidCommand:
        ours = False
    assert ours == (_hf_ok(text) and text != "")


def test_subject_verb_must_match_the_body():
    body = msgspec.json.encode(Evict(command_id="c1", all=True))
    assert isinstance(decode_command(body, verb="evict"), Evict)
    with pytest.raises(InvalidCommand, match="'evict' sent on the subject of 'scale'"):
        decode_command(body, verb="scale")
    with pytest.raises(InvalidCommand):
        decode_command(msgspec.json.encode(Scale(command_id="c2", model_key="m", replicas=1)), verb="deploy")


@pytest.mark.parametrize("cid", ["", "a b", "x\nNats-Msg-Id: forged", "c" * 129, "caf\u00e9"])
def test_command_ids_are_bounded_tokens(cid):
    with pytest.raises(InvalidCommand, match="command id"):
        decode_command(msgspec.json.encode(Deploy(command_id=cid, model_key="m")))


def test_actor_is_bounded():
    with pytest.raises(InvalidCommand, match="actor"):
        decode_command(msgspec.json.encode(Deploy(command_id="c", model_key="m", actor="x" * 201)))
    with pytest.raises(InvalidCommand, match="actor"):
        decode_command(msgspec.json.encode(Deploy(command_id="c", model_key="m", actor="")))


# ---- decide_unplaced ----------------------------------------------------------------------------------


def _apply(b: Builder, events: list[E.Event]) -> None:
    for ev in events:
        b.add(ev)


def _one_node_two_replicas() -> Builder:
    b = Builder().node("n0", gpus=2, gpu_gb=80)
    b.hot("m", 0, "n0", (0,), 10).hot("m", 1, "n0", (1,), 10).target("m", 2)
    return b


def test_a_lost_node_keeps_its_unplaceable_replicas_wanted():
    b = _one_node_two_replicas()
    events = decide_node_lost(b.state, "n0", ctx("lost"), "heartbeat expired")
    assert [type(e).__name__ for e in events] == ["NodeLost", "PlacementRejected"]
    _apply(b, events)
    wanted = [r for r in b.state.replicas.values() if r.desired is Level.HOT and r.state is S.LOST]
    assert len(wanted) == 2 and b.state.replica_count("m") == 2
    assert decide_unplaced(b.state, ctx("u1")) == []  # no room anywhere: nothing is appended


def test_rejoin_places_the_wanted_replicas_again_and_then_nothing_more():
    b = _one_node_two_replicas()
    _apply(b, decide_node_lost(b.state, "n0", ctx("lost"), "heartbeat expired"))
    b.node("n0", gpus=2, gpu_gb=80)  # the agent rejoins
    events = decide_unplaced(b.state, ctx("u2"))
    assert events == decide_unplaced(b.state, ctx("u2"))  # deterministic
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["ReplicaEvictionRequested"] * 2 + ["ReplicaScheduled"] * 2
    assert all(e.reason is EvictionReason.NODE_LOST and e.target is Level.COLD for e in events[:2])
    assert {e.replica_id for e in events[2:]} == {2, 3}  # fresh ids; the lost ones end COLD
    _apply(b, events)
    assert b.state.replica_count("m") == 2 and b.state.anomaly_count == 0
    assert decide_unplaced(b.state, ctx("u3")) == []


def test_room_elsewhere_is_used_and_running_replicas_are_never_pushed_out():
    b = _one_node_two_replicas()
    b.node("n1", gpus=1, gpu_gb=80)
    b.hot("other", 0, "n1", (0,), 75, loaded_at=T0 + timedelta(hours=1))  # n1 is full, just loaded
    events = decide_node_lost(b.state, "n0", ctx("lost"), "gone")
    assert not any(isinstance(e, E.ReplicaScheduled) for e in events)
    _apply(b, events)
    later = ctx("u4", now=T0 + timedelta(hours=10), seed=1)  # `other` is old enough for pressure now
    assert decide_unplaced(b.state, later) == []  # a lost replica never pushes a running one out
    b.node("n2", gpus=1, gpu_gb=15)  # room appears: one of the two fits
    events = decide_unplaced(b.state, ctx("u5"))
    assert sum(isinstance(e, E.ReplicaScheduled) for e in events) == 1
    assert sum(isinstance(e, E.ReplicaEvictionRequested) for e in events) == 1
    _apply(b, events)
    assert sum(1 for r in b.state.replicas.values() if r.state is S.LOST and r.desired is Level.HOT) == 1
    assert decide_unplaced(b.state, ctx("u6")) == []


@settings(max_examples=60, deadline=None)
@example(steps=["lose-0", "lose-1", "join-0", "place"], replicas=1, seed=0)
@example(steps=["lose-0", "join-2", "place", "join-0", "place"], replicas=4, seed=1)
@given(st.lists(st.sampled_from(["lose-0", "lose-1", "join-0", "join-1", "join-2", "place"]), max_size=14),
       st.integers(1, 4), st.integers(0, 3))
def test_unplaced_placement_laws(steps, replicas, seed):
    """Any sequence of losses and (re)joins: placement never over-commits, never keeps more wanted
    replicas than the target, places nothing twice, and is idempotent once applied."""
    b = Builder().node("n0", gpus=2, gpu_gb=40).node("n1", gpus=2, gpu_gb=40)
    for i in range(replicas):
        b.hot("m", i, f"n{i % 2}", (i // 2 % 2,), 30)
    b.target("m", replicas)
    for i, step in enumerate(steps):
        c = ctx(f"s{i}", seed=seed)
        if step.startswith("lose"):
            events = decide_node_lost(b.state, f"n{step[-1]}", c, "test")
        elif step.startswith("join"):
            events = [E.NodeJoined(**b._env("agent"), node_id=f"n{step[-1]}", cpu_cache_bytes=0,
                                   gpus=tuple(E.GpuInfo(index=g, memory_bytes=40 * GB) for g in range(2)))]
        else:
            events = decide_unplaced(b.state, c)
            assert events == decide_unplaced(b.state, ctx(f"s{i}", seed=seed))  # deterministic (a fresh context)
            assert not any(isinstance(e, E.ReplicaEvictionRequested) and e.reason is EvictionReason.PRESSURE
                           for e in events)
        _apply(b, events)
        for ev in events:  # the agent loads what was scheduled at once
            if isinstance(ev, E.ReplicaScheduled):
                b.add(E.ReplicaLoaded(**b._env("agent"), model_key=ev.model_key, replica_id=ev.replica_id,
                                      node_id=ev.node_id))
        if step == "place":
            assert decide_unplaced(b.state, ctx(f"again{i}", seed=seed)) == []
        assert b.state.replica_count("m") == replicas  # wanted replicas are neither lost nor doubled
        for node_id, node in b.state.nodes.items():
            for g in node.gpus:
                assert b.state.card_committed(node_id, g.index) <= g.memory_bytes
        assert b.state.anomaly_count == 0, b.state.anomalies
