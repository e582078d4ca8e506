"""The fast placement scan decides exactly as exhaustive ranking of every node.

`placement._choose` stops at the first node that fits at the best level, rejects full nodes from a
per-node index kept by the projection, and prunes the eviction search; the reference ranks every
node at every level. On random clusters (mixed cards, multi-GPU replicas, WARM copies, dedicated
and young replicas) and random multi-model requests, both must return the same plan.
"""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core import placement
from controlplane.core.placement import PlacementRequest, plan
from tests.cluster_builder import GB, T0, Builder
from tests.unit.test_decide_properties import reference_choose

CARD_GB = [24, 40, 80]
MODELS = [f"m{i}" for i in range(6)]


@st.composite
def clusters(draw: st.DrawFn) -> Builder:
    b = Builder()
    rid = {m: 0 for m in MODELS}
    for n in range(draw(st.integers(1, 5))):
        node = f"n{n}"
        cards = draw(st.integers(1, 4))
        card_gb = draw(st.sampled_from(CARD_GB))
        b.node(node, gpus=cards, gpu_gb=card_gb, cpu_gb=draw(st.sampled_from([0, 30, 200])))
        free = [float(card_gb)] * cards
        for _ in range(draw(st.integers(0, 6))):
            m = draw(st.sampled_from(MODELS))
            span = draw(st.sampled_from([1, 1, 1, 2]))
            gb = draw(st.sampled_from([3.0, 7.0, 11.5, 20.0, 35.0]))
            gpus = tuple(i for i in range(cards) if free[i] >= gb)[:span]
            if len(gpus) < span:
                continue
            for i in gpus:
                free[i] -= gb
            age = draw(st.sampled_from([10, 400, 4000]))
            if draw(st.integers(0, 5)) == 0 and m in b.state.models:
                b.warm(m, rid[m], node, gpus, gb)
            else:
                b.hot(m, rid[m], node, gpus, gb, dedicated=draw(st.integers(0, 4)) == 0,
                      loaded_at=T0 + timedelta(hours=1) - timedelta(seconds=age))
            rid[m] += 1
    return b


requests = st.lists(
    st.builds(PlacementRequest, model_key=st.sampled_from(MODELS), size_bytes=st.sampled_from([2, 6, 10, 17, 30, 45, 70]).map(
        lambda g: g * GB), replicas=st.integers(1, 3), dedicated=st.booleans()),
    min_size=1, max_size=3, unique_by=lambda r: r.model_key,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), requests, st.integers(0, 10))
def test_fast_scan_equals_exhaustive_ranking(b: Builder, reqs: list[PlacementRequest], seed: int) -> None:
    now_s = (T0 + timedelta(hours=1)).timestamp()
    fast = plan(b.state, reqs, now_s=now_s, seed=seed)
    saved = placement._choose
    placement._choose = reference_choose
    try:
        slow = plan(b.state, reqs, now_s=now_s, seed=seed)
    finally:
        placement._choose = saved
    assert fast == slow
