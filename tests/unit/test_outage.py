"""The outage rule, pure: a start after a gap longer than the grace is a `ClusterDown`, kept by the
fold (and its snapshots), said by `history`/`events`; a first start or a short gap is none."""

from __future__ import annotations

from datetime import timedelta

from controlplane.core.decide import decide_outage
from controlplane.core.projections import ClusterState, decode_snapshot, encode_snapshot
from controlplane.core.projections.cluster import MAX_OUTAGES
from controlplane.core.reasons import event_reason
from schemas import events as E
from tests.cluster_builder import T0, Builder, ctx


def test_a_gap_past_the_grace_is_recorded_from_the_last_thing_heard():
    b = Builder().node("n0")  # its events at T0
    now = T0 + timedelta(minutes=20)
    assert decide_outage(ClusterState(), None, ctx("o", now=now), 20.0) == []  # an empty log: a first start
    assert decide_outage(b.state, None, ctx("o", now=T0 + timedelta(seconds=19)), 20.0) == []  # within the grace
    beat = T0 + timedelta(minutes=5)  # the server last stored a beat or an event then
    (down,) = decide_outage(b.state, beat, ctx("o", now=now), 20.0)
    assert isinstance(down, E.ClusterDown) and (down.down_from, down.up_at) == (beat, now)
    assert down.down_s == 15 * 60 and "cluster down 900 s" in event_reason(down)
    (bodies,) = decide_outage(b.state, None, ctx("o", now=now), 20.0)  # no server time: the log's last event
    assert bodies.down_from == T0


def test_a_fact_dated_in_the_future_hides_no_outage():
    """An agent's fact may carry any time in its body: the rule reads the server's times, and a
    body's time is never taken as later than now."""
    b = Builder().node("n0")
    b.add(E.NodeJoined(**b._env("agent:n0", ts=T0.replace(year=2099)), node_id="n0", gpus=(), cpu_cache_bytes=0))
    now = T0 + timedelta(minutes=20)
    (down,) = decide_outage(b.state, T0, ctx("o", now=now), 20.0)  # what the server stamped wins
    assert down.down_from == T0
    assert decide_outage(b.state, None, ctx("o", now=now), 20.0) == []  # clamped to now: no gap, nothing made up


def test_the_fold_keeps_the_newest_outages_and_snapshots_keep_them():
    b = Builder().node("n0")
    for i in range(MAX_OUTAGES + 3):
        start = T0 + timedelta(hours=i + 1)
        for e in decide_outage(b.state, None, ctx(f"o{i}", now=start), 20.0):
            b.add(e)
    assert len(b.state.outages) == MAX_OUTAGES and b.state.outages[-1].up_at == T0 + timedelta(hours=MAX_OUTAGES + 3)
    again = decode_snapshot(encode_snapshot(b.state))
    assert again.outages == b.state.outages and b.state.copy().outages == b.state.outages
