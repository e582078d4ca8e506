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
    beat = T0 + timedelta(minutes=5)  # an agent was heard after the last event
    (down,) = decide_outage(b.state, beat, ctx("o", now=now), 20.0)
    assert isinstance(down, E.ClusterDown) and (down.down_from, down.up_at) == (beat, now)
    assert down.down_s == 15 * 60 and "cluster down 900 s" in event_reason(down)
    (older,) = decide_outage(b.state, T0 - timedelta(hours=1), ctx("o", now=now), 20.0)
    assert older.down_from == T0  # the log's own last event is later than the beat: counted from it


def test_the_fold_keeps_the_newest_outages_and_snapshots_keep_them():
    b = Builder().node("n0")
    for i in range(MAX_OUTAGES + 3):
        start = T0 + timedelta(hours=i + 1)
        for e in decide_outage(b.state, None, ctx(f"o{i}", now=start), 20.0):
            b.add(e)
    assert len(b.state.outages) == MAX_OUTAGES and b.state.outages[-1].up_at == T0 + timedelta(hours=MAX_OUTAGES + 3)
    again = decode_snapshot(encode_snapshot(b.state))
    assert again.outages == b.state.outages and b.state.copy().outages == b.state.outages
