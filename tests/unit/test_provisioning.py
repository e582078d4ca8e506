"""The dispatcher's view of a rejected deploy: never placeable vs no room now; what a retry depends on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.core.capacity import capacity_mark, never_fits
from controlplane.core.placement import PlacementRequest, padded, plan
from tests.cluster_builder import GB, T0, Builder


def test_no_node_yet_is_not_never() -> None:
    assert never_fits(Builder().state, 10 * GB) is None  # an agent may still join


def test_nodes_without_gpus_can_never_place_and_say_how_to_declare_them() -> None:
    why = never_fits(Builder().node("cpu-box", gpus=0).state, 1 * GB)
    assert why is not None and "no node has a GPU" in why and "--gpus N" in why


def test_larger_than_every_node_names_the_largest_card_and_the_need() -> None:
    b = Builder().node("a", gpus=2, gpu_gb=24).node("b", gpus=1, gpu_gb=80)
    assert never_fits(b.state, 80 * GB) is None  # one card of b
    assert never_fits(b.state, 48 * GB) is None  # two cards of a (placement spans a node's cards)
    why = never_fits(b.state, 81 * GB)
    assert why is not None and "largest card is 74.51 GiB" in why and "needs 75.44 GiB" in why  # 80e9, 81e9 bytes


@given(cards=st.lists(st.integers(1, 4), min_size=1, max_size=4), card_gb=st.integers(1, 100),
       need_gb=st.integers(1, 500))
def test_never_fits_agrees_with_placement_on_an_empty_cluster(cards: list[int], card_gb: int, need_gb: int) -> None:
    """never_fits is None exactly when placement would place one replica on the empty cluster."""
    b = Builder()
    for i, n in enumerate(cards):
        b.node(f"n{i}", gpus=n, gpu_gb=card_gb)
    size = need_gb * GB
    b.model("m", size / GB)
    p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=size, replicas=1)], now_s=T0.timestamp())
    assert (never_fits(b.state, padded(size)) is None) == bool(p.placed)


def test_capacity_mark_changes_with_what_placement_sees() -> None:
    b = Builder().node("a", gpus=1, gpu_gb=80)
    now = T0.timestamp() + 10
    before = capacity_mark(b.state, now)
    b.target("x", 1)  # a rejected deploy's own events change nothing placement looks at
    assert capacity_mark(b.state, now) == before
    b.hot("m", 0, "a", (0,), 70)  # a card filled
    filled = capacity_mark(b.state, now)
    assert filled != before
    assert capacity_mark(b.state, now + 3600) != filled  # time alone made the replica evictable
    b.node("b", gpus=1, gpu_gb=80)  # a node joined
    assert capacity_mark(b.state, now) != filled
