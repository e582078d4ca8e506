"""Placement on synthetic clusters: each candidate level, sharing, multi-GPU, evictions, caching."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.core.placement import Candidate, PlacementRequest, padded, plan
from schemas import events as E
from schemas.status import EvictionReason, Level
from tests.cluster_builder import GB, T0, Builder

A, B = "node-a", "node-b"
NOW = (T0 + timedelta(hours=1)).timestamp()


def one(state, model, gb, n=1, dedicated=False, now=NOW, **kw):
    return plan(state, [PlacementRequest(model_key=model, size_bytes=int(gb * GB), replicas=n, dedicated=dedicated)],
                now_s=now, **kw)


def test_free_on_an_empty_node_takes_a_share_of_one_card():
    s = Builder().node(A).state
    p = one(s, "m", 10)
    (pl,) = p.placed
    assert pl.candidate is Candidate.FREE and len(pl.gpu_indices) == 1
    assert pl.bytes_per_gpu == padded(10 * GB) and pl.source is Level.COLD and pl.replica_id == 0


def test_a_card_holding_a_share_stays_usable_for_another_model():
    s = Builder().node(A, gpus=1).hot("x", 0, A, (0,), 30).state
    (pl,) = one(s, "m", 30).placed
    assert pl.gpu_indices == (0,)  # 30 + 34.5 <= 80: shares the card


def test_multi_gpu_is_charged_an_even_share_per_card():
    s = Builder().node(A).state
    (pl,) = one(s, "big", 150).placed  # 172.5 GB padded -> 3 cards of 57.5
    assert len(pl.gpu_indices) == 3 and pl.bytes_per_gpu * 3 >= padded(150 * GB)
    assert pl.bytes_per_gpu == -(-padded(150 * GB) // 3)


def test_deployed_when_every_node_holds_the_model_on_the_node_with_fewest_and_another_card():
    # Spread: a node already holding the model no longer attracts its new replicas; when
    # every node holds it, the one with fewer replicas takes it, on a card without one.
    s = Builder().node(A).node(B).hot("m", 0, A, (0,), 12).hot("m", 1, B, (0,), 12).hot("m", 2, B, (1,), 12).state
    for seed in range(5):  # whatever the tie-break
        (pl,) = one(s, "m", 10, seed=seed).placed
        assert pl.node_id == A and pl.candidate is Candidate.DEPLOYED and pl.replica_id == 3
        assert pl.gpu_indices != (0,)


def test_warm_is_reused_first_keeping_its_id():
    s = Builder().node(A).node(B).hot("m", 0, A, (0,), 12).warm("m", 1, B, (0,), 12).state
    (pl,) = one(s, "m", 10).placed
    assert (pl.node_id, pl.replica_id, pl.source, pl.candidate) == (B, 1, Level.WARM, Candidate.CACHED_AND_FREE)


def test_cached_and_full_beats_full():
    b = Builder().node(A, gpus=1, cpu_gb=100).node(B, gpus=1, cpu_gb=100)
    b.hot("x", 0, A, (0,), 75).hot("y", 0, B, (0,), 75)
    b.warm("m", 3, A, (0,), 1)  # a WARM copy of m on A (tiny on the card)
    (pl,) = one(b.state, "m", 40).placed
    assert pl.node_id == A and pl.candidate is Candidate.CACHED_AND_FULL and pl.replica_id == 3
    p = one(b.state, "m", 40)
    assert [(e.model_key, e.node_id) for e in p.evictions if e.model_key == "x"] == [("x", A)]


def test_full_evicts_fewest_then_smallest():
    b = Builder().node(A, gpus=1, cpu_gb=0)
    b.hot("s1", 0, A, (0,), 10).hot("s2", 0, A, (0,), 10).hot("s3", 0, A, (0,), 10).hot("l", 0, A, (0,), 45)
    p = one(b.state, "m", 20)  # needs 23 GB, 5 free: one eviction of l (45) beats three of 10
    assert [e.model_key for e in p.evictions] == ["l"]
    assert p.placed[0].candidate is Candidate.FULL
    b2 = Builder().node(A, gpus=1, cpu_gb=0)
    b2.hot("a", 0, A, (0,), 30).hot("b", 0, A, (0,), 25).hot("c", 0, A, (0,), 20)
    p2 = one(b2.state, "m", 20)  # need 23 - 5 = 18: the smallest single that suffices is c (20)
    assert [e.model_key for e in p2.evictions] == ["c"]


def test_dedicated_is_never_evicted_and_partial_success_is_reported():
    b = Builder().node(A, gpus=2).hot("d", 0, A, (0,), 75, dedicated=True).hot("e", 0, A, (1,), 75, dedicated=True)
    p = one(b.state, "m", 10, n=2)
    assert not p.placed and not p.evictions
    (sf,) = p.shortfalls
    assert sf.replicas == 2 and sf.needed_bytes == padded(10 * GB) and sf.free_bytes == 5 * GB
    b2 = Builder().node(A, gpus=2)
    p2 = one(b2.state, "m", 60, n=3)  # two cards: two replicas fit, the third does not
    assert len(p2.placed) == 2 and p2.shortfalls[0].replicas == 1


def test_minimum_deployment_time_protects_fresh_replicas_from_non_dedicated_requesters():
    fresh = T0 + timedelta(hours=1) - timedelta(seconds=10)
    b = Builder().node(A, gpus=1).hot("x", 0, A, (0,), 75, loaded_at=fresh)
    assert one(b.state, "m", 10).shortfalls  # too fresh to evict
    assert [e.model_key for e in one(b.state, "m", 10, dedicated=True).evictions] == ["x"]
    later = NOW + 400
    assert [e.model_key for e in one(b.state, "m", 10, now=later).evictions] == ["x"]


def test_evicted_hot_goes_warm_if_the_cache_allows_else_cold():
    b = Builder().node(A, gpus=1, cpu_gb=100).hot("x", 0, A, (0,), 75)
    (ev,) = one(b.state, "m", 10).evictions
    assert ev.target is Level.WARM
    b2 = Builder().node(A, gpus=1, cpu_gb=50).hot("x", 0, A, (0,), 75)
    (ev2,) = one(b2.state, "m", 10).evictions
    assert ev2.target is Level.COLD


def test_cpu_cache_overflow_drops_the_smallest_warm_first():
    b = Builder().node(A, gpus=1, cpu_gb=100)
    b.warm("w1", 0, A, (0,), 10).warm("w2", 0, A, (0,), 20).warm("w3", 0, A, (0,), 60)  # 90 of 100 cached
    b.hot("x", 0, A, (0,), 70)  # on evicting x (70) the cache must free 60: w1 (10), w2 (20), then w3
    p = one(b.state, "m", 60)
    drops = [(e.model_key, e.target) for e in p.evictions if e.model_key != "x"]
    assert drops[:2] == [("w1", Level.COLD), ("w2", Level.COLD)]
    assert [e.target for e in p.evictions if e.model_key == "x"] == [Level.WARM]


def test_largest_model_placed_first():
    s = Builder().node(A, gpus=1).state
    p = plan(s, [PlacementRequest(model_key="small", size_bytes=30 * GB, replicas=1),
                 PlacementRequest(model_key="large", size_bytes=60 * GB, replicas=1)], now_s=NOW)
    assert [pl.model_key for pl in p.placed] == ["large"] and p.shortfalls[0].model_key == "small"


def test_placement_is_deterministic_and_seeded():
    b = Builder()
    for i in range(6):
        b.node(f"n{i}")
    plans = {seed: one(b.state, "m", 10, n=3, seed=seed) for seed in range(8)}
    assert one(b.state, "m", 10, n=3, seed=3) == plans[3]
    assert len({tuple(pl.node_id for pl in p.placed) for p in plans.values()}) > 1


@pytest.mark.parametrize("level", list(Candidate))
def test_every_candidate_level_is_covered(level):
    # (guards the list above: a new level without a test here fails)
    assert level.name in {"DEPLOYED", "CACHED_AND_FREE", "FREE", "CACHED_AND_FULL", "FULL", "CANT_ACCOMMODATE"}


def test_replicas_of_one_model_fill_a_nodes_cards_evenly():
    """Once every card holds a replica of the model, the next goes to the card holding the fewest:
    4 replicas on 2 free cards land 2+2, not 3+1."""
    s = Builder().node(A, gpus=2).state
    p = one(s, "m", 1, n=4)
    per_card = sorted(sum(1 for pl in p.placed if pl.gpu_indices == (g,)) for g in (0, 1))
    assert per_card == [2, 2], [pl.gpu_indices for pl in p.placed]


def test_a_new_replica_takes_a_free_card_over_one_a_leaving_replica_still_holds():
    """Best fit alone would pick the fuller card that a replica is leaving (its load would wait for
    the eviction); a free card that fits wins."""
    b = Builder().node(A, gpus=2).hot("other", 0, A, (0,), 30)
    b.add(E.ReplicaEvictionRequested(event_id="ev-x", ts=T0, actor="controller", model_key="other", replica_id=0,
                                     node_id=A, reason=EvictionReason.ADMIN, target=Level.WARM))
    (pl,) = one(b.state, "m", 10).placed
    assert pl.gpu_indices == (1,)
