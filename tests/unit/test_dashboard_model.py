"""The dashboard's read model: past states from checkpoints equal a fold from the start; queries refuse bad input."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.projections import ClusterState, replay
from controlplane.dashboard.model import BadQuery, DashboardModel, UnknownEntity, node_json, nodes_json, state_json
from tests.strategies import histories, numbered, scripted_history

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def without_ids(state: ClusterState) -> object:
    return msgspec.structs.replace(state.to_snapshot(), event_ids=[])


@SETTINGS
@given(histories(), st.integers(1, 7), st.data())
def test_any_position_equals_a_fold_from_the_start(events, every, data):
    """Checkpoints (which drop event ids) + the skipped re-appends reach replay's state exactly."""
    items = numbered(events)
    m = DashboardModel(checkpoint_every=every)
    m.add_all(items)
    assert without_ids(m.live) == without_ids(replay(items))
    for seq in data.draw(st.lists(st.integers(0, len(items)), min_size=1, max_size=6)):
        want = replay(items, until_seq=seq)
        got = m.state_at(seq)
        assert without_ids(got) == without_ids(want), seq
        assert state_json(got, last_seq=m.seq, live=False) == state_json(want, last_seq=m.seq, live=False)
        # The one-pass view of every node is the per-node view the live updates send.
        assert nodes_json(got) == [node_json(got, n) for n in sorted(got.nodes)]


def test_past_states_are_not_the_live_one_and_never_change_it():
    items = numbered(scripted_history(10))
    m = DashboardModel(checkpoint_every=5)
    m.add_all(items)
    before = without_ids(m.live)
    mid = m.state_at(len(items) // 2)
    assert mid is not m.live and mid.seq == len(items) // 2
    assert without_ids(m.live) == before
    assert m.state_at(m.seq) is m.live


def test_until_time_maps_like_replay_and_bad_input_is_refused():
    items = numbered(scripted_history(4))
    m = DashboardModel()
    m.add_all(items)
    t = items[5][1].ts
    seq = m.parse_until(t.isoformat())
    assert without_ids(m.state_at(seq)) == without_ids(replay(items, until_time=t))
    assert m.parse_until("1999-01-01T00:00:00Z") == 0
    with pytest.raises(BadQuery, match="past the end"):
        m.parse_until(str(m.seq + 1))
    with pytest.raises(BadQuery, match="ISO time"):
        m.parse_until("yesterday")
    with pytest.raises(BadQuery, match="timezone"):
        m.parse_until("2026-01-01T00:00:00")


def test_events_filters_paging_and_history():
    items = numbered(scripted_history(6))
    m = DashboardModel()
    m.add_all(items)
    rows, nxt = m.events(limit=5)
    assert [r["seq"] for r in rows] == list(range(len(items), len(items) - 5, -1)) and nxt == rows[-1]["seq"]
    older, _ = m.events(limit=5, before=nxt)
    assert older[0]["seq"] == nxt - 1
    mk = next(k for k in m.model_rows)
    one, _ = m.events(model=mk, replica_id=1, limit=1000)
    assert one and all(r["model_key"] == mk and r["replica_id"] == 1 for r in one)
    typed, _ = m.events(type_="ReplicaLoaded", limit=1000)
    assert typed and all(r["type"] == "ReplicaLoaded" for r in typed)
    agents, _ = m.events(actor="agent", limit=1000)
    assert agents and all("agent" in r["actor"] for r in agents)
    h = m.history(mk, 1)
    assert h["steps"][0]["type"] == "ReplicaScheduled" and h["steps"][0]["state"] == "LoadRequested"
    # Each step's state is the one the full fold had right after it.
    for s in h["steps"]:
        assert replay(items, until_seq=s["seq"]).replicas[(mk, 1)].state == s["state"]
    for bad in ({"limit": 0}, {"limit": 1001}, {"type_": "Frobnicated"}):
        with pytest.raises(BadQuery):
            m.events(**bad)
    with pytest.raises(UnknownEntity):
        m.events(model="nobody/nothing")
    with pytest.raises(UnknownEntity):
        m.history(mk, 999)


def test_events_re_appended_long_after_are_skipped_from_checkpoints_too():
    """An event stored again past the dedup window changes nothing in a fold from the start; a fold
    from a checkpoint (which does not keep event ids) must skip it the same way."""
    events = scripted_history(6)
    again = [events[i] for i in range(len(events) // 3, len(events) // 3 + 6)]  # re-appended much later
    items = numbered(events + again + events[-3:])
    m = DashboardModel(checkpoint_every=4)
    m.add_all(items)
    assert len(m.dup_seqs) == len(again) + 3
    for seq in range(len(events) - 2, len(items) + 1):
        assert without_ids(m.state_at(seq)) == without_ids(replay(items, until_seq=seq)), seq


def test_a_lost_node_is_shown_lost_with_its_replicas_gone():
    from datetime import timedelta

    from schemas import events as E

    events = scripted_history(4)
    node = next(e.node_id for e in events if isinstance(e, E.NodeJoined))
    last = events[-1]
    lost = E.NodeLost(event_id="lost-1", ts=last.ts + timedelta(seconds=1), actor="controller:test", node_id=node)
    m = DashboardModel()
    m.add_all(numbered(events + [lost]))
    before = next(n for n in state_json(m.state_at(m.seq - 1), last_seq=m.seq, live=False)["nodes"]
                  if n["node_id"] == node)
    after = next(n for n in state_json(m.live, last_seq=m.seq, live=True)["nodes"] if n["node_id"] == node)
    assert before["alive"] and any(c["replicas"] for c in before["gpus"])
    assert not after["alive"] and not any(c["replicas"] for c in after["gpus"]) and after["warm"] == []
