"""The replica's turns (dataplane/replica/turns.py): one run at a time; when it ends, the waiting
request of the user served least recently goes next, and one user's requests keep their order."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.replica.model import ExecutionTimeout, ModelReplica
from dataplane.replica.turns import Turns
from schemas.status import Level


def _queue_behind_holder(turns: Turns, users: list[str]) -> tuple[list[str], list[threading.Thread]]:
    """Hold the turn as `holder`, then line up one waiter per entry of `users` in that order; each
    waiter records itself when it gets the turn and ends it at once."""
    assert turns.acquire("holder", timeout=1)
    served: list[str] = []
    threads = []
    for i, user in enumerate(users):
        def wait(user: str = user, i: int = i) -> None:
            assert turns.acquire(user, timeout=20)
            served.append(f"{user}#{i}")
            turns.release()
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 10
        while turns.waiting() < i + 1:  # in line before the next one comes
            assert time.monotonic() < deadline
            time.sleep(0.001)
    return served, threads


def test_a_light_users_request_goes_before_a_floods_calls_already_waiting() -> None:
    turns = Turns()
    # the flood's user was just served (it holds the turn as "heavy"), three more of its calls wait
    assert turns.acquire("heavy", timeout=1)
    turns.release()
    served, threads = _queue_behind_holder(turns, ["heavy", "heavy", "heavy", "light"])
    turns.release()
    for t in threads:
        t.join(10)
    assert served == ["light#3", "heavy#0", "heavy#1", "heavy#2"], served


def test_a_request_that_waits_too_long_gives_up_its_place_and_the_others_go_on() -> None:
    turns = Turns()
    assert turns.acquire("a", timeout=1)
    t0 = time.monotonic()
    assert not turns.acquire("b", timeout=0.05)
    assert time.monotonic() - t0 >= 0.05 and turns.waiting() == 0
    turns.release()
    assert turns.acquire("b", timeout=1)  # the gate is free again: nothing was left holding it
    turns.release()


def test_forgotten_users_count_as_never_served_and_memory_stays_bounded() -> None:
    turns = Turns(remembered=3)
    for u in ["a", "b", "c", "d"]:
        assert turns.acquire(u, timeout=1)
        turns.release()
    assert list(turns._served) == ["b", "c", "d"]  # "a" forgotten: the oldest


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["u1", "u2", "u3", "u4"]), min_size=1, max_size=10))
def test_service_goes_round_the_waiting_users_and_keeps_each_users_order(users: list[str]) -> None:
    turns = Turns()
    served, threads = _queue_behind_holder(turns, users)
    turns.release()
    for t in threads:
        t.join(10)
    assert sorted(served) == sorted(f"{u}#{i}" for i, u in enumerate(users))  # nothing lost
    order = [(s.split("#")[0], int(s.split("#")[1])) for s in served]
    for u in set(users):  # one user's requests in the order they came
        mine = [i for v, i in order if v == u]
        assert mine == sorted(mine)
    # Round robin: at every point, the users that still had requests waiting were served within one
    # request of each other (the light user never waits for a second turn of a heavy one).
    left = {u: users.count(u) for u in set(users)}
    done = dict.fromkeys(left, 0)
    for u, _ in order:
        waiting = [v for v in left if left[v] > 0]
        assert done[u] == min(done[v] for v in waiting), (order, u)
        done[u] += 1
        left[u] -= 1


# ---- the turns inside ModelReplica (its run stubbed: no weights, the gate and the timeouts are real)

FORWARD = {"op": "forward", "input_ids": [[1, 2]]}


def _replica(run_s: dict[str, float], ran: list[str], timeout_s: float = 5.0) -> ModelReplica:
    r = ModelReplica("k", 0, "/nowhere", execution_timeout_s=timeout_s)
    r.level, r.model = Level.HOT, object()

    def fake_run(op: str, request: dict[str, Any]) -> dict[str, Any]:
        ran.append(request["who"])
        time.sleep(run_s.get(request["who"], 0.0))
        return {"who": request["who"]}

    r._run = fake_run  # type: ignore[method-assign]
    return r


def _in_thread(r: ModelReplica, who: str, user: str, out: dict[str, Any]) -> threading.Thread:
    def call() -> None:
        try:
            out[who] = r.timed({**FORWARD, "who": who}, user)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[who] = exc
    t = threading.Thread(target=call, daemon=True)
    t.start()
    return t


def test_a_replica_runs_a_light_users_request_before_the_floods_waiting_ones() -> None:
    ran: list[str] = []
    r = _replica({"h0": 0.3}, ran)
    out: dict[str, Any] = {}
    threads = [_in_thread(r, "h0", "heavy", out)]
    while ran != ["h0"]:
        time.sleep(0.001)
    for i, (who, user) in enumerate([("h1", "heavy"), ("h2", "heavy"), ("l1", "light")]):
        threads.append(_in_thread(r, who, user, out))
        while r._turns.waiting() < i + 1:
            time.sleep(0.001)
    for t in threads:
        t.join(10)
    assert ran == ["h0", "l1", "h1", "h2"], ran
    # the seconds a request ran, not its wait for the turn (the dispatcher's batch budget uses them)
    assert out["h0"][1] >= 0.3 and out["l1"][1] < 0.2, out


def test_a_request_waits_for_its_turn_at_most_one_timeout_and_a_run_past_its_timeout_keeps_the_turn() -> None:
    ran: list[str] = []
    r = _replica({"slow": 0.6}, ran, timeout_s=0.25)
    out: dict[str, Any] = {}
    started = time.monotonic()
    slow = _in_thread(r, "slow", "a", out)
    while ran != ["slow"]:
        time.sleep(0.001)
    t0 = time.monotonic()
    with pytest.raises(ExecutionTimeout, match="busy"):
        r({**FORWARD, "who": "never"}, "b")  # the slow run holds the turn past this wait
    assert 0.2 < time.monotonic() - t0 < 0.5 and "never" not in ran
    slow.join(5)
    assert isinstance(out["slow"], ExecutionTimeout) and "ran longer" in str(out["slow"])
    time.sleep(max(0.0, started + 0.7 - time.monotonic()))  # the run itself ends at 0.6 s
    t1 = time.monotonic()
    assert r({**FORWARD, "who": "next"}, "b") == {"who": "next"}  # the turn came back when the run ended
    assert time.monotonic() - t1 < 0.2 and ran == ["slow", "next"]
