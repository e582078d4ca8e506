"""The replica process pool's bookkeeping (dataplane/runtime/pool.py) and its heartbeat line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.store.heartbeats import beat_counts, beat_value
from dataplane.runtime.pool import MAX_POOL_SIZE, Pool, check_size, member_name, member_number
from schemas.subjects import node_token


def test_refill_take_and_refill_again() -> None:
    pool = Pool("ray-node-1", 2)
    names = pool.refill()
    assert names == [member_name("ray-node-1", 0), member_name("ray-node-1", 1)]
    for n in names:
        pool.started(n, f"handle-{n}")
    assert pool.refill() == []  # starting members count toward the size
    assert pool.take() is None and pool.report() == (0, 2)  # none ready yet: nothing to take
    pool.up(names[1])
    assert pool.report() == (1, 2)
    assert pool.take() == (names[1], f"handle-{names[1]}")
    assert pool.report() == (0, 2)
    again = pool.refill()
    assert again == [member_name("ray-node-1", 2)]  # a new number: the taken one is a replica now


def test_failed_members_leave_and_are_replaced() -> None:
    pool = Pool("n", 1)
    [name] = pool.refill()
    pool.started(name, "h")
    pool.failed(name)
    pool.up(name)  # a late answer from a member already out does not bring it back
    assert pool.report() == (0, 1) and pool.take() is None
    assert pool.refill() == [member_name("n", 1)]


def test_seen_numbers_are_never_reused() -> None:
    pool = Pool("n", 1)
    pool.seen([0, 7, 3])
    assert pool.refill() == [member_name("n", 8)]
    assert member_number("n", member_name("n", 8)) == 8
    assert member_number("n", member_name("other", 8)) is None
    assert member_number("n", "ModelActor:m:0") is None


def test_size_zero_starts_nothing_and_bad_sizes_are_refused() -> None:
    assert Pool("n", 0).refill() == []
    for bad in (-1, MAX_POOL_SIZE + 1):
        with pytest.raises(ValueError, match="pool size"):
            check_size(bad)


@given(st.lists(st.sampled_from(["refill", "up", "take", "fail"]), max_size=60), st.integers(0, 4))
def test_never_more_members_than_its_size_and_names_unique(ops: list[str], size: int) -> None:
    pool = Pool("n", size)
    used: set[str] = set()
    for op in ops:
        if op == "refill":
            for name in pool.refill():
                assert name not in used
                used.add(name)
                pool.started(name, name)
        elif op == "up" and pool.starting:
            pool.up(next(iter(pool.starting)))
        elif op == "take":
            got = pool.take()
            assert got is None or got[0] in used
        elif op == "fail" and pool.starting:
            pool.failed(next(iter(pool.starting)))
        assert len(pool.starting) + len(pool.ready) <= size
        ready, total = pool.report()
        assert 0 <= ready <= total == size


def test_a_beat_with_its_pool_counts_and_junk_after_the_id_does_not() -> None:
    key = node_token("node-a")
    assert beat_counts(key, beat_value("node-a", (1, 2)))
    assert beat_counts(key, beat_value("node-a"))
    assert not beat_counts(key, b"node-a\nsomething else")
    assert not beat_counts(key, b"node-a\npool 1/")
    assert not beat_counts(node_token("node-b"), beat_value("node-a", (1, 1)))
