"""The dashboard's read model and its reach into the past: any position (from the newest snapshot plus
the events after it, in memory or read from the log) equals a fold from the start; events pages and
histories that go past what memory keeps equal the whole log's; queries refuse bad input."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.projections import ClusterState, fold, replay
from controlplane.core.projections.snapshot import encode_stored, snapshot_name
from controlplane.dashboard.model import (
    BadQuery,
    DashboardModel,
    UnknownEntity,
    event_row,
    event_type,
    node_json,
    nodes_json,
    state_json,
)
from controlplane.dashboard.past import Past
from controlplane.store.memlog import MemoryEventLog
from controlplane.store.rebuild import newest_snapshot
from schemas import events as E
from schemas.events import encode_event, event_subject
from tests.strategies import histories, numbered, scripted_history

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


async def dashboard(events: list[E.Event], *, window: int = 100_000, snapshots: tuple[int, ...] = ()) -> Past:
    """A dashboard's model and past over a log holding exactly `events`, started as the server starts:
    from the newest snapshot (stored at each of `snapshots`), then the events after it."""
    log = MemoryEventLog()
    for ev in events:
        log.store_raw(event_subject(ev), encode_event(ev), ev.event_id, ev.ts)
    pairs = numbered(events)
    for cut in snapshots:
        header, data = encode_stored(fold(pairs[:cut], ClusterState()))
        await log.save_snapshot(snapshot_name(header), data)
    start = await newest_snapshot(log)
    m = DashboardModel(start.state, window=window)
    async for batch in log.read_batches(start.state.seq + 1):
        m.add_all(batch)
    return Past(log, m)


@SETTINGS
@given(histories(), st.integers(1, 7), st.data())
def test_any_position_equals_a_fold_from_the_start(events, window, data):
    """From a snapshot, with most events out of memory (a small window): every past state is replay's."""
    items = numbered(events)
    cuts = tuple(data.draw(st.lists(st.integers(0, len(items)), max_size=3), label="snapshots"))

    async def run() -> None:
        past = await dashboard(events, window=window, snapshots=cuts)
        m = past.model
        assert m.live == replay(items) and len(m.items) <= window + max(1, window // 10)
        for seq in data.draw(st.lists(st.integers(0, len(items)), min_size=1, max_size=6), label="positions"):
            want = replay(items, until_seq=seq)
            got = await past.at_seq(seq)
            assert got == want, seq
            assert state_json(got, last_seq=m.seq, live=False) == state_json(want, last_seq=m.seq, live=False)
            # The one-pass view of every node is the per-node view the live updates send.
            assert nodes_json(got) == [node_json(got, n) for n in sorted(got.nodes)]
        k = data.draw(st.integers(0, len(items) - 1), label="time of event")
        t = items[k][1].ts
        seq, got = await past.at_time(t)
        assert got == replay(items, until_time=t) and seq == got.seq

    asyncio.run(run())


async def test_past_states_are_not_the_live_one_and_never_change_it():
    items = numbered(scripted_history(10))
    past = await dashboard([e for _, e in items], window=5, snapshots=(7,))
    m = past.model
    before = m.live.to_snapshot()
    mid = await past.at_seq(len(items) // 2)
    assert mid is not m.live and mid.seq == len(items) // 2
    assert m.live.to_snapshot() == before
    assert await past.at_seq(m.seq) is m.live
    with pytest.raises(BadQuery):
        await past.at_seq(-1)


async def test_until_parses_a_seq_or_a_zoned_time_and_refuses_the_rest():
    items = numbered(scripted_history(4))
    past = await dashboard([e for _, e in items])
    m = past.model
    assert m.parse_until(str(m.seq)) == m.seq
    assert (await past.at_time(items[5][1].ts))[1] == replay(items, until_time=items[5][1].ts)
    seq, st = await past.at_time(items[0][1].ts - timedelta(days=1))
    assert seq == 0 and st == ClusterState()
    with pytest.raises(BadQuery, match="past the end"):
        m.parse_until(str(m.seq + 1))
    with pytest.raises(BadQuery, match="ISO time"):
        m.parse_until("yesterday")
    with pytest.raises(BadQuery, match="timezone"):
        m.parse_until("2026-01-01T00:00:00")


def brute_events(items: list[tuple[int, Any]], *, model: str | None = None, replica: int | None = None,
                 type_: str | None = None, actor: str | None = None) -> list[dict[str, Any]]:
    out = []
    for seq, item in reversed(items):
        if model is not None and not (isinstance(item, E.Event) and item.model_key == model):
            continue
        if replica is not None and not (isinstance(item, E.ReplicaEvent) and item.replica_id == replica):
            continue
        if type_ is not None and event_type(item) != type_:
            continue
        if actor is not None and not (isinstance(item, E.Event) and actor in item.actor):
            continue
        out.append(event_row(seq, item))
    return out


async def pages(past: Past, **kw: Any) -> list[dict[str, Any]]:
    rows, before = [], None
    for _ in range(1000):
        got, before = await past.events(before=before, **kw)
        rows += got
        if before is None:
            return rows
    raise AssertionError("paging did not end")


@pytest.mark.parametrize("window", [3, 1000])
async def test_events_pages_and_history_reach_past_what_memory_keeps(window):
    items = numbered(scripted_history(6))
    past = await dashboard([e for _, e in items], window=window, snapshots=(9, 20))
    m = past.model
    mk = next(e.model_key for _, e in items if isinstance(e, E.ReplicaEvent))
    first, nxt = await past.events(limit=5)
    assert [r["seq"] for r in first] == list(range(len(items), len(items) - 5, -1)) and nxt == first[-1]["seq"]
    older, _ = await past.events(limit=5, before=nxt)
    assert older[0]["seq"] == nxt - 1
    for kw in ({"limit": 7}, {"model": mk, "replica_id": 1, "limit": 3}, {"type_": "ReplicaLoaded", "limit": 2},
               {"actor": "agent", "limit": 1000}):
        want = brute_events(items, model=kw.get("model"), replica=kw.get("replica_id"), type_=kw.get("type_"),
                            actor=kw.get("actor"))
        assert await pages(past, **kw) == want, kw
    h = await past.history(mk, 1)
    assert h["steps"][0]["type"] == "ReplicaScheduled" and h["steps"][0]["state"] == "LoadRequested"
    assert h["next_before"] is None
    # Each step's state is the one the full fold had right after it.
    for s in h["steps"]:
        assert replay(items, until_seq=s["seq"]).replicas[(mk, 1)].state == s["state"]
    assert [s["seq"] for s in h["steps"]] == [r["seq"] for r in reversed(brute_events(items, model=mk, replica=1))]
    whole = await past.history(mk, None)
    assert [s["seq"] for s in whole["steps"]] == [r["seq"] for r in reversed(brute_events(items, model=mk))]
    for bad in ({"limit": 0}, {"limit": 1001}, {"type_": "Frobnicated"}):
        with pytest.raises(BadQuery):
            await past.events(**bad)
    with pytest.raises(UnknownEntity):
        await past.events(model="nobody/nothing")
    with pytest.raises(UnknownEntity):
        await past.history(mk, 999)
    assert m.resolve_model(mk) == mk


async def test_a_history_page_covers_a_stretch_and_says_where_older_steps_are(monkeypatch):
    import controlplane.dashboard.past as past_mod

    monkeypatch.setattr(past_mod, "HISTORY_SPAN", 10)
    items = numbered(scripted_history(8))
    past = await dashboard([e for _, e in items], window=4, snapshots=(12,))
    mk = next(e.model_key for _, e in items if isinstance(e, E.ReplicaEvent))
    steps, before = [], None
    while True:
        h = await past.history(mk, None, before=before)
        steps = h["steps"] + steps
        before = h["next_before"]
        if before is None:
            break
    assert [s["seq"] for s in steps] == [r["seq"] for r in reversed(brute_events(items, model=mk))]
    for s in steps:
        if "replica_id" in s:
            r = replay(items, until_seq=s["seq"]).replicas.get((mk, s["replica_id"]))
            assert (r.state if r else None) == (s["state"] or None)


async def test_a_lost_node_is_shown_lost_with_its_replicas_gone():
    events = scripted_history(4)
    node = next(e.node_id for e in events if isinstance(e, E.NodeJoined))
    last = events[-1]
    lost = E.NodeLost(event_id="lost-1", ts=last.ts + timedelta(seconds=1), actor="controller:test", node_id=node)
    past = await dashboard([*events, lost])
    m = past.model
    before = next(n for n in state_json(await past.at_seq(m.seq - 1), last_seq=m.seq, live=False)["nodes"]
                  if n.node_id == node)
    after = next(n for n in state_json(m.live, last_seq=m.seq, live=True)["nodes"] if n.node_id == node)
    assert before.alive and any(c.replicas for c in before.gpus)
    assert not after.alive and not any(c.replicas for c in after.gpus) and after.warm == []
