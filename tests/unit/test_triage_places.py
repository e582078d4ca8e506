"""The triage's places (controlplane/core/fairness.py `TriagePlaces`): bounded in all and per user,
the users' lines served in turn, and no free place left while an eligible name waits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.fairness import TriagePlaces


def _check(tp: TriagePlaces) -> None:
    held: dict[str, int] = {}
    for user in tp.running.values():
        held[user] = held.get(user, 0) + 1
    assert len(tp.running) <= tp.places
    assert all(n <= tp.share for n in held.values()), held
    assert held == tp._held
    assert len(tp.waiting) <= tp.waiting_limit
    assert not set(tp.running) & set(tp.waiting)
    assert all(len(line) <= tp.waiting_share for line in tp._lines.values())
    # every waiting name is in some line (else nothing would ever start it but the sweep)
    lined = {t for line in tp._lines.values() for t in line}
    assert set(tp.waiting) <= lined
    assert set(tp._compacted) <= set(tp._lines)  # bounded by the lines there are


def test_one_user_holds_its_share_and_another_starts_at_once() -> None:
    tp = TriagePlaces(places=16, share=4, waiting_limit=100, waiting_share=10)
    started = [t for t in range(20) if tp.ask(f"m{t}", "mallory", True) is not None]
    assert started == [0, 1, 2, 3]  # the rest wait in mallory's line (10), then go to the sweep
    assert len(tp.waiting) == 10
    assert tp.ask("b0", "bob", True) is True  # a place is free and bob holds none: at once
    _check(tp)


def test_the_lines_are_served_in_turn() -> None:
    tp = TriagePlaces(places=2, share=2, waiting_limit=100, waiting_share=100)
    assert tp.ask("x", "x", False) is not None and tp.ask("y", "y", False) is not None
    for i in range(5):
        tp.ask(f"a{i}", "alice", False)
    for i in range(2):
        tp.ask(f"b{i}", "bob", True)
    order: list[str] = []
    while tp.running:
        order += [t for t, _, _ in tp.done(next(iter(tp.running)))]  # the oldest triage ends
        _check(tp)
    assert order[:4] == ["a0", "b0", "a1", "b1"], order  # alternating while both wait
    assert sorted(order) == sorted([f"a{i}" for i in range(5)] + ["b0", "b1"])


def test_a_name_keeps_its_freshness_while_it_waits() -> None:
    tp = TriagePlaces(places=1, share=1)
    assert tp.ask("first", "u", False) is False
    assert tp.ask("late", "u", True) is None
    assert tp.done("first") == [("late", "u", True)]
    assert tp.ask("again", "u", False) is None
    assert tp.ask("again", "u", True) is None  # a publish on it while waiting
    assert tp.done("late") == [("again", "u", True)]


def test_a_name_waiting_in_another_users_line_joins_this_users_line_too() -> None:
    tp = TriagePlaces(places=2, share=1)
    tp.ask("m0", "mallory", False)
    tp.ask("shared", "mallory", False)  # waits behind mallory's share
    tp.ask("b0", "bob", False)
    tp.ask("shared", "bob", True)  # bob's own request on it: in bob's line as well
    started = tp.done("b0")
    assert started == [("shared", "bob", True)], started
    _check(tp)
    assert tp.done("m0") == []  # mallory's stale entry is skipped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 30), st.booleans()), max_size=300))
def test_bounds_hold_and_no_place_stays_free_while_an_eligible_name_waits(ops: list[tuple[bool, int, int, bool]]) -> None:
    tp = TriagePlaces(places=4, share=2, waiting_limit=12, waiting_share=5)
    for ask, user, name, fresh in ops:
        if ask:
            if f"n{name}" not in tp.running:
                tp.ask(f"n{name}", f"u{user}", fresh)
        elif tp.running:
            tp.done(sorted(tp.running)[name % len(tp.running)])
        _check(tp)
        if len(tp.running) < tp.places:
            held: dict[str, int] = {}
            for u in tp.running.values():
                held[u] = held.get(u, 0) + 1
            for u, line in tp._lines.items():
                if held.get(u, 0) < tp.share:
                    assert not [t for t in line if t in tp.waiting], (u, line, tp.running)


def test_a_line_does_not_count_names_started_from_another_users_line() -> None:
    tp = TriagePlaces(places=2, share=1, waiting_limit=100, waiting_share=3)
    tp.ask("a-run", "alice", False)
    for t in ("t0", "t1", "t2"):
        assert tp.ask(t, "alice", False) is None  # alice's line is full (3)
    tp.ask("b-run", "bob", False)
    tp.done("b-run")  # bob's place goes to ... nobody of bob's: alice holds her share
    for t in ("t0", "t1"):
        assert tp.ask(t, "bob", True) is True  # bob starts them ahead of alice's turn ...
        tp.done(t)
    assert tp.ask("t3", "alice", False) is None and "t3" in tp.waiting  # ... and alice's line has room
    _check(tp)


def test_with_every_line_full_a_shorter_line_takes_the_longest_lines_newest_place() -> None:
    tp = TriagePlaces(places=1, share=1, waiting_limit=6, waiting_share=5)
    tp.ask("run", "x", False)
    for i in range(5):
        tp.ask(f"m{i}", "mallory", False)
    tp.ask("e0", "eve", False)  # all 6 waiting places taken
    assert tp.ask("b0", "bob", True) is None and "b0" in tp.waiting and "m4" not in tp.waiting
    assert tp.given_up == 1
    assert tp.ask("e1", "eve", False) is None and "e1" in tp.waiting and "m3" not in tp.waiting
    assert tp.ask("e2", "eve", False) is None and "e2" not in tp.waiting  # mallory's line (3) is no longer than eve's would be
    _check(tp)


def test_a_full_line_is_not_rebuilt_for_every_name_asked_for() -> None:
    """A sweep asks for every stored name: with a line full, rebuilding it each time cost ~25 us a
    name (1.5 s of a blocked loop at 60,000 names). It is compacted only when names have left."""
    tp = TriagePlaces(places=2, share=1, waiting_limit=100, waiting_share=3)
    tp.ask("run", "m", False)
    for i in range(3):
        tp.ask(f"m{i}", "m", False)
    tp.ask("m-extra", "m", False)  # full: compacted once
    line = tp._lines["m"]
    for i in range(50):
        assert tp.ask(f"more{i}", "m", False) is None
    assert tp._lines["m"] is line  # not rebuilt
    assert tp.ask("m1", "bob", True) is True  # started ahead of its turn: m's line may be stale now
    assert tp.ask("m-new", "m", False) is None and "m-new" in tp.waiting  # compacted: room again
    _check(tp)
