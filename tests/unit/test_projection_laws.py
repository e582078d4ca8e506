"""The laws of the cluster projection, as Hypothesis properties."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.projections import ClusterState, decode_snapshot, encode_snapshot, evolve, fold
from controlplane.core.projections.replica import ReplicaView
from schemas.events import EVENT_TYPES, decode_event, encode_event
from tests.strategies import any_event, histories, numbered

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def full(events):
    return fold(numbered(events), ClusterState())


def recomputed_cards(state: ClusterState) -> dict[tuple[str, int], int]:
    """Each card's reservation computed from scratch from the replica views."""
    out: dict[tuple[str, int], int] = {}
    for r in state.replicas.values():
        if r.on_gpu:
            for g in r.gpu_indices:
                out[(r.node_id, g)] = out.get((r.node_id, g), 0) + r.bytes_per_gpu
    return out


@SETTINGS
@given(histories())
def test_fold_is_deterministic(events):
    a, b = full(events), full(events)
    assert a == b
    # ...and independent of the wire: the same history decoded from its JSON folds the same.
    wire = [decode_event(encode_event(e)) for e in events]
    assert full(wire) == a


@SETTINGS
@given(histories(), st.data())
def test_snapshot_plus_tail_equals_full_fold_at_every_cut(events, data):
    pairs = numbered(events)
    whole = fold(pairs, ClusterState())
    for cut in range(len(pairs) + 1):
        prefix = fold(pairs[:cut], ClusterState())
        resumed = fold(pairs[cut:], decode_snapshot(encode_snapshot(prefix)))
        assert resumed == whole, f"cut at {cut}"


@SETTINGS
@given(histories(), st.data())
def test_redelivering_any_event_changes_nothing(events, data):
    pairs = numbered(events)
    whole = fold(pairs, ClusterState())
    i = data.draw(st.integers(0, len(pairs) - 1))
    # The consumer redelivers seq i again right after (or much later): ignored.
    again = pairs[: i + 1] + [pairs[i]] + pairs[i + 1 :] + [pairs[i]]
    assert fold(again, ClusterState()) == whole
    # The same event appended again at a new seq (after the dedup window): only the position moves.
    seq_end = len(pairs) + 1
    twice = fold(pairs + [(seq_end, pairs[i][1])], ClusterState())
    assert twice.seq == seq_end
    assert twice.to_snapshot().replicas == whole.to_snapshot().replicas
    assert twice.to_snapshot().models == whole.to_snapshot().models
    assert twice.anomaly_count == whole.anomaly_count


@SETTINGS
@given(histories(chaos=True), st.randoms(use_true_random=False))
def test_any_interleaving_never_crashes_and_memory_stays_exact(events, rnd):
    # Observed events out of order and duplicated, on top of the chaos the strategy already adds.
    events = list(events)
    head, tail = events[:4], events[4:]
    rnd.shuffle(tail)
    tail += rnd.sample(tail, k=min(len(tail), 5))
    state = ClusterState()
    for seq, ev in numbered(head + tail):
        state.apply(seq, ev)
        expected = recomputed_cards(state)
        for node_id in state.nodes:
            for card in state.node_cards(node_id):
                assert card.reserved_bytes >= 0
                assert card.reserved_bytes == expected.get((node_id, card.index), 0)
                assert state.card_reserved(node_id, card.index) == card.reserved_bytes
                staying = sum(r.bytes_per_gpu for r in state.replicas.values()
                              if r.on_gpu and r.node_id == node_id and card.index in r.gpu_indices
                              and r.desired == "HOT")
                assert card.committed_bytes == staying
                # A replica is on a card at most once (no double count).
                keys = [(m, r) for m, r, _ in card.replicas]
                assert len(keys) == len(set(keys))
        cached = {}
        for r in state.replicas.values():
            if r.cpu_bytes:
                cached[r.node_id] = cached.get(r.node_id, 0) + r.cpu_bytes
        for node_id in state.nodes:
            assert state.cpu_cached(node_id) == cached.get(node_id, 0)
            # The CPU commitment's running totals equal the sum over the views they index.
            kept = sum(r.cpu_bytes for r in state.replicas.values()
                       if r.node_id == node_id and r.cpu_bytes and r.desired != "COLD")
            promised = sum(r.bytes_per_gpu * len(r.gpu_indices) for r in state.replicas.values()
                           if r.node_id == node_id and r.on_gpu and r.desired == "WARM" and not r.cpu_bytes)
            assert state.cpu_pending(node_id) == promised
            assert state.cpu_committed(node_id) == kept + promised
            assert state.copy().cpu_committed(node_id) == kept + promised


@SETTINGS
@given(any_event())
def test_every_event_round_trips(event):
    assert decode_event(encode_event(event)) == event


def test_strategy_covers_every_event_type():
    seen: set[str] = set()

    @settings(max_examples=400, deadline=None, database=None)
    @given(any_event())
    def collect(e):
        seen.add(type(e).__struct_config__.tag)

    collect()
    assert seen == set(EVENT_TYPES)


@SETTINGS
@given(histories(), st.data())
def test_evolve_is_pure(events, data):
    pairs = numbered(events)
    k = data.draw(st.integers(0, len(pairs) - 1))
    before = fold(pairs[:k], ClusterState())
    snap = encode_snapshot(before)
    after = evolve(before, *pairs[k])
    assert encode_snapshot(before) == snap  # untouched
    assert after == fold(pairs[: k + 1], ClusterState())


def test_replica_view_is_frozen():
    import pytest

    r = ReplicaView(model_key="m", replica_id=0, desired="HOT", state="Available")
    with pytest.raises(AttributeError):
        r.state = "Failed"  # type: ignore[misc]
