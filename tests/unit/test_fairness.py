"""The fair-queueing rules (controlplane/core/fairness.py): shares, bands, limits, positions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.fairness import (
    FairnessPolicy,
    FairQueue,
    FifoQueue,
    RequestQueue,
    Share,
    decode_policy,
    position_update_due,
    request_queue,
    wait_estimate_s,
)
from schemas.errors import InvalidCommand


@dataclass(eq=False)
class Req:
    user: str
    n: int
    tags: list[str] = field(default_factory=list)


def q_of(policy: FairnessPolicy | None = None) -> FairQueue[Req]:
    return FairQueue(policy or FairnessPolicy(), lambda r: r.user)


def policy(weights: dict[str, float] | None = None, **default: int) -> FairnessPolicy:
    return FairnessPolicy(default=Share(**default),  # type: ignore[arg-type]
                          users={u: Share(weight=w) for u, w in (weights or {}).items()})


def push_new(q: RequestQueue[Req], queued: list[Req], user: str, n: int) -> int:
    """Push request number `n` of `user` and note it as queued; the next number."""
    r = Req(user, n)
    q.push(r)
    queued.append(r)
    return n + 1


def drain(q: FairQueue[Req]) -> list[Req]:
    out = []
    while (r := q.pop()) is not None:
        out.append(r)
        q.release(r)
    return out


def test_a_light_users_request_goes_before_a_heavy_users_backlog() -> None:
    q = q_of()
    for i in range(1000):
        q.push(Req("heavy", i))
    light = Req("light", 0)
    q.push(light)
    assert q.position(light) == 1  # one heavy request (arrived first at the same virtual time) before it
    order = drain(q)
    assert order.index(light) == 1


def test_weights_split_dispatches() -> None:
    q = q_of(policy({"a": 3.0, "b": 1.0}))
    for i in range(400):
        q.push(Req("a", i))
        q.push(Req("b", i))
    first = drain(q)[:200]
    assert abs(sum(r.user == "a" for r in first) - 150) <= 2


def test_a_higher_band_goes_first_and_fair_within_it() -> None:
    p = FairnessPolicy(tiers={"gold": Share(band=1)}, user_tiers={"g1": "gold", "g2": "gold"})
    q = q_of(p)
    for i in range(5):
        q.push(Req("plain", i))
    for i in range(4):
        q.push(Req("g1", i))
    for i in range(4):
        q.push(Req("g2", i))
    order = [r.user for r in drain(q)]
    assert order[:8] == ["g1", "g2"] * 4
    assert order[8:] == ["plain"] * 5


def test_running_limit_makes_a_user_wait_and_others_go() -> None:
    q = q_of(policy(max_running=2))
    for i in range(5):
        q.push(Req("a", i))
    q.push(Req("b", 0))
    got = [q.pop(), q.pop(), q.pop()]
    assert [r.user for r in got if r] == ["a", "b", "a"]
    assert q.pop() is None and not q.ready()
    q.release(got[0])  # type: ignore[arg-type]
    nxt = q.pop()
    assert nxt is not None and nxt.user == "a"


def test_queued_limit_refuses_with_limit_and_count() -> None:
    q = q_of(policy(max_queued=3))
    for i in range(3):
        assert q.admit("a") is None
        q.push(Req("a", i))
    refused = q.admit("a")
    assert refused is not None and (refused.limit, refused.count) == (3, 3)
    assert "3 requests queued" in refused.message("gpt2") and "limit is 3" in refused.message("gpt2")
    assert q.admit("b") is None


def test_push_back_restores_the_place_and_the_running_count() -> None:
    q = q_of(policy(max_running=1))
    reqs = [Req("a", i) for i in range(3)]
    for r in reqs:
        q.push(r)
    first = q.pop()
    assert first is reqs[0] and q.running("a") == 1
    q.push_back(first)
    assert q.running("a") == 0 and list(q) == reqs
    q.release(first)  # a release after push_back changes nothing
    assert q.running("a") == 0


def test_removing_a_backlog_leaves_no_debt() -> None:
    q = q_of()
    heavy = [Req("heavy", i) for i in range(100)]
    for r in heavy:
        q.push(r)
    q.push(Req("other", 0))
    for r in heavy[1:]:
        assert q.remove(r)
    assert not q.remove(heavy[5])
    late = Req("heavy", 999)
    q.push(late)
    assert q.position(late) == 2


def test_policy_decoding() -> None:
    p = decode_policy(b'{"default": {"max_queued": 10}, "tiers": {"pro": {"weight": 4, "band": 1}},'
                      b'"user_tiers": {"alice": "pro"}, "users": {"alice": {"max_running": 3}}}')
    a, b = p.share("alice"), p.share("bob")
    assert (a.weight, a.band, a.max_queued, a.max_running) == (4.0, 1, 10, 3)
    assert (b.weight, b.band, b.max_queued) == (1.0, 0, 10)
    for bad in (b'{"default": {"weight": 0}}', b'{"user_tiers": {"a": "nope"}}', b'{"nope": 1}', b'[', b'\xff',
                b'{"default": {"max_running": 0}}'):
        with pytest.raises(InvalidCommand):
            decode_policy(bad)


def test_wait_estimate_and_update_rule() -> None:
    assert wait_estimate_s(0, None, 2) is None and wait_estimate_s(3, 1.0, 0) is None
    assert wait_estimate_s(3, 0.5, 2) == 1.0
    assert position_update_due(None, 50, 0.0, 1.0)
    assert not position_update_due(50, 50, 10.0, 1.0)
    assert not position_update_due(50, 40, 0.5, 1.0)  # too soon
    assert position_update_due(50, 40, 1.5, 1.0)  # moved by a fifth
    assert not position_update_due(500, 499, 5.0, 1.0)  # a small move far from the head
    assert position_update_due(10, 9, 1.0, 1.0)  # near the head


# ---- properties --------------------------------------------------------------------------------

users_st = st.sampled_from(["a", "b", "c", "d"])
ops_st = st.lists(st.one_of(
    st.tuples(st.just("push"), users_st),
    st.tuples(st.just("pop"), st.just("")),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("push_back"), st.integers(0, 50)),
    st.tuples(st.just("remove"), st.integers(0, 200)),
), max_size=200)


@settings(max_examples=200, deadline=None)
@given(ops=ops_st, max_running=st.integers(1, 4),
       weights=st.dictionaries(users_st, st.floats(0.1, 10), max_size=4),
       bands=st.dictionaries(users_st, st.integers(0, 2), max_size=4))
def test_nothing_is_lost_or_reordered_within_a_user_and_limits_hold(ops: list[tuple[str, object]], max_running: int,
                                                                     weights: dict[str, float],
                                                                     bands: dict[str, int]) -> None:
    p = FairnessPolicy(default=Share(max_running=max_running),
                       users={u: Share(weight=weights.get(u), band=bands.get(u)) for u in {*weights, *bands}})
    q = q_of(p)
    queued: list[Req] = []  # what should be queued (any order)
    running: list[Req] = []
    n = 0
    started: dict[str, list[int]] = {}  # user -> numbers of its requests in the order first taken
    for op, arg in ops:
        if op == "push":
            n = push_new(q, queued, str(arg), n)
        elif op == "pop":
            top = max((p.share(r.user).band for r in queued if q.running(r.user) < max_running), default=None)
            got = q.pop()
            if got is None:
                assert all(q.running(r.user) >= max_running for r in queued)
                continue
            # The highest band among eligible users first, and its user's oldest request.
            assert got in queued
            assert got.n == min(r.n for r in queued if r.user == got.user)  # its user's oldest
            assert p.share(got.user).band == top
            queued.remove(got)
            running.append(got)
            if "back" not in got.tags:
                started.setdefault(got.user, []).append(got.n)
            assert q.running(got.user) <= max_running
        elif op == "release" and running:
            r = running.pop(int(arg) % len(running))  # type: ignore[call-overload]
            q.release(r)
        elif op == "push_back" and running:
            r = running.pop(int(arg) % len(running))  # type: ignore[call-overload]
            r.tags.append("back")
            q.push_back(r)
            queued.append(r)
        elif op == "remove" and queued:
            r = queued.pop(int(arg) % len(queued))  # type: ignore[call-overload]
            assert q.remove(r)
        assert len(q) == len(queued)
        assert sorted(id(r) for r in q) == sorted(id(r) for r in queued)
        for u in "abcd":
            assert q.running(u) == sum(r.user == u for r in running) <= max_running
    for nums in started.values():
        assert nums == sorted(nums)  # each user's requests first start in the order they came
    for i, r in enumerate(list(q)):
        assert q.position(r) == i


@settings(max_examples=200, deadline=None)
@given(backlog=st.integers(0, 3000), done_before=st.integers(0, 500), light_n=st.integers(1, 20),
       w_heavy=st.floats(0.1, 10), w_light=st.floats(0.1, 10))
def test_a_light_users_wait_is_bounded_by_its_share_whatever_the_backlog(backlog: int, done_before: int, light_n: int,
                                                                        w_heavy: float, w_light: float) -> None:
    q = q_of(policy({"heavy": w_heavy, "light": w_light}))
    for i in range(backlog):
        q.push(Req("heavy", i))
    for _ in range(min(done_before, backlog)):
        r = q.pop()
        assert r is not None
        q.release(r)
    light = [Req("light", i) for i in range(light_n)]
    for r in light:
        q.push(r)
    order = drain(q)
    for j, r in enumerate(light):
        # Before the light user's j-th request: its j earlier ones and the heavy requests that
        # start within j / w_light of virtual time (j * w_heavy / w_light of them, plus one).
        assert order.index(r) <= j + math.floor(j * w_heavy / w_light + 1e-9) + 1


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.floats(0.2, 5), min_size=2, max_size=4), n=st.integers(10, 300))
def test_weights_hold_while_everyone_is_backlogged(weights: list[float], n: int) -> None:
    users = [f"u{i}" for i in range(len(weights))]
    q = q_of(policy(dict(zip(users, weights, strict=True))))
    for i in range(n + 10):
        for u in users:
            q.push(Req(u, i))
    taken = [r.user for r in drain(q)[:n]]
    total = sum(weights)
    for u, w in zip(users, weights, strict=True):
        assert abs(taken.count(u) - n * w / total) <= len(users)


# ---- FIFO (NDIF_FAIRNESS order "fifo": the baseline tools/bench/fairness.py measures) -------------

def test_fifo_goes_in_arrival_order_over_users_and_keeps_limits() -> None:
    p = decode_policy(b'{"order": "fifo", "default": {"max_running": 2, "max_queued": 3}}')
    q: RequestQueue[Req] = request_queue(p, lambda r: r.user)
    assert isinstance(q, FifoQueue)
    heavy = [Req("heavy", i) for i in range(3)]
    for r in heavy:
        q.push(r)
    light = Req("light", 0)
    q.push(light)
    assert q.position(light) == 3  # behind the whole backlog: what fair queueing is for
    refused = q.admit("heavy")
    assert refused is not None and (refused.limit, refused.count) == (3, 3)
    a, b = q.pop(), q.pop()
    assert [a, b] == heavy[:2]
    assert q.pop() is light  # heavy is at its running limit: the first request of another user goes
    assert q.users() == {"heavy": (1, 2), "light": (0, 1)}
    assert b is not None
    q.push_back(b)
    assert list(q) == [b, heavy[2]] and q.running("heavy") == 1


@settings(max_examples=200, deadline=None)
@given(ops=ops_st, max_running=st.integers(1, 4))
def test_fifo_loses_nothing_and_keeps_arrival_order(ops: list[tuple[str, object]], max_running: int) -> None:
    q: FifoQueue[Req] = FifoQueue(FairnessPolicy(order="fifo", default=Share(max_running=max_running)),
                                  lambda r: r.user)
    queued: list[Req] = []  # in arrival order
    running: list[Req] = []
    n = 0
    for op, arg in ops:
        if op == "push":
            n = push_new(q, queued, str(arg), n)
        elif op == "pop":
            eligible = [r for r in queued if q.running(r.user) < max_running]
            got = q.pop()
            if got is None:
                assert not eligible
                continue
            assert got is eligible[0]  # the oldest request of a user under its running limit
            queued.remove(got)
            running.append(got)
        elif op in ("release", "push_back") and running:
            r = running.pop(int(arg) % len(running))  # type: ignore[call-overload]
            if op == "release":
                q.release(r)
            else:
                q.push_back(r)
                queued.append(r)
                queued.sort(key=lambda x: x.n)  # back in its own place
        elif op == "remove" and queued:
            r = queued.pop(int(arg) % len(queued))  # type: ignore[call-overload]
            assert q.remove(r) and not q.remove(r)
        assert list(q) == queued and len(q) == len(queued)
        assert all(q.position(r) == i for i, r in enumerate(queued))
        for u in "abcd":
            assert q.queued(u) == sum(r.user == u for r in queued)
            assert q.running(u) == sum(r.user == u for r in running) <= max_running


def test_a_full_processor_stops_reading_only_its_heavier_partitions() -> None:
    """Two users at their queue limit (5,000 each) fill what a processor holds (MAX_HELD): their
    partitions stop being read, a third user's is still read, and what is held stays bounded."""
    from dataplane.serving.dispatcher.intake import HELD_SHARE, MAX_HELD, PartitionHold
    from schemas.subjects import REQUEST_PARTITIONS, request_partition

    users = iter(f"user{i}" for i in range(10_000))
    a = next(users)
    b = next(u for u in users if request_partition(u) != request_partition(a))
    c = next(u for u in users if request_partition(u) not in (request_partition(a), request_partition(b)))
    q = q_of(FairnessPolicy(default=Share(max_queued=MAX_HELD)))
    holding = PartitionHold(q, recount_s=0.0)  # counted at every call here
    for i in range(MAX_HELD // 2 - 1):
        q.push(Req(a, i))
        q.push(Req(b, i))
    assert not any(holding(k) for k in [None, *range(REQUEST_PARTITIONS)])  # under MAX_HELD: all read
    q.push(Req(a, -1))
    q.push(Req(b, -1))
    assert holding(request_partition(a)) and holding(request_partition(b))
    assert not holding(request_partition(c)) and not holding(None)
    for i in range(HELD_SHARE):  # the third user's partition fills to its share, then it is held too
        assert not holding(request_partition(c))
        q.push(Req(c, i))
    assert holding(request_partition(c))
    assert len(q) <= MAX_HELD + HELD_SHARE * (REQUEST_PARTITIONS + 1)
