"""Fair dispatch through the whole dispatcher over the in-memory log and serving ports, with the real
controller and node agent (tests/unit/test_dispatcher_memlog.py's stack, a replica that takes 10 ms
a request): a light user is not queued behind a heavy user's backlog, a user past its queued limit
is refused at once with the limit and the count, queued requests hear of their moving position and
wait estimate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from controlplane.core.fairness import FairnessPolicy, Share
from dataplane.replica.wire import Answer, Completed, Failed, NotRun
from schemas.status import RequestStatus
from schemas.subjects import subject_matches
from tests.fake_runtime import FakeProcess, FakeRuntime
from tests.memory_stack import Stack, memory_stack
from tests.unit.test_dispatcher_memlog import EchoCaller, checkpoint, final, request
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)
R = RequestStatus
RUN_S = 0.01


class SlowCaller(EchoCaller):
    """Each request takes RUN_S on the replica (one at a time per replica), so a backlog builds."""

    def __init__(self, runtime: FakeRuntime) -> None:
        super().__init__(runtime)
        self.order: list[str] = []  # users, in the order their requests ran
        self._busy: dict[int, asyncio.Lock] = {}

    async def run_batch(self, handle: FakeProcess, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        if handle.level != "HOT":
            return [NotRun(reason=f"replica is {handle.level}")] * len(payloads)
        out: list[Answer] = []
        async with self._busy.setdefault(handle.spec.replica_id, asyncio.Lock()):
            for p in payloads:
                await asyncio.sleep(RUN_S)
                self.order.append(str(p.get("data", "")).split(":")[0])
                out.append(Completed(result={"echo": p.get("data")}, seconds=RUN_S))
        return out


async def make_stack(tmp_path: Any, policy: FairnessPolicy) -> AsyncIterator[tuple[Stack, SlowCaller]]:
    callers: list[SlowCaller] = []

    def make(runtime: FakeRuntime) -> SlowCaller:
        callers.append(SlowCaller(runtime))
        return callers[0]

    async with memory_stack(make, fairness=policy) as s:
        yield s, callers[0]


@pytest_asyncio.fixture
async def fair(tmp_path: Any) -> AsyncIterator[tuple[Stack, SlowCaller]]:
    async for s in make_stack(tmp_path, FairnessPolicy()):
        yield s


@pytest_asyncio.fixture
async def limited(tmp_path: Any) -> AsyncIterator[tuple[Stack, SlowCaller]]:
    async for s in make_stack(tmp_path, FairnessPolicy(users={"heavy": Share(max_queued=5)})):
        yield s


def queued_statuses(stack: Stack, request_id: str) -> list[tuple[int, float | None]]:
    """(queue position, wait estimate) of each QUEUED status published for the request."""
    out = []
    for subject, body in stack.serving.published:
        if subject_matches(subject, "ndif.status.>") and subject.endswith(request_id):
            s = msgspec.json.decode(body)
            if s["status"] == "QUEUED":
                out.append((s["queue_position"], s.get("wait_estimate_s")))
    return out


async def warmed(stack: Stack, tmp_path: Any, user: str) -> str:
    """A model whose replica has served one request of `user` (deployed and loaded): its key."""
    mk = checkpoint(tmp_path, "tiny")
    warm = request(mk, 0, user=user)
    await stack.serving.submit(warm)
    assert (await final(stack, warm)).status is R.COMPLETED
    return mk


async def submit_all(stack: Stack, mk: str, user: str, n: int) -> list[Any]:
    reqs = [request(mk, f"{user}:{i}", user=user) for i in range(n)]  # type: ignore[arg-type]
    for r in reqs:
        await stack.serving.submit(r)
    return reqs


async def test_a_light_user_is_served_while_a_heavy_users_backlog_is_still_large(fair: tuple[Stack, SlowCaller],
                                                                                 tmp_path: Any) -> None:
    stack, caller = fair
    mk = await warmed(stack, tmp_path, "heavy")
    heavy = await submit_all(stack, mk, "heavy", 400)
    proc = next(iter(stack.dispatcher.processors.values()))
    await until(lambda: proc.queue.queued("heavy") > 300, timeout=10)
    light = [request(mk, f"light:{i}", user="light") for i in range(10)]  # type: ignore[arg-type]
    for r in light:
        await stack.serving.submit(r)
    for r in light:
        assert (await final(stack, r)).status is R.COMPLETED
    assert proc.queue.queued("heavy") > 200  # the light user's requests did not wait for the backlog
    # Once the light user had a request queued, it never waited behind more than one heavy request.
    first_light = caller.order.index("light")
    assert caller.order[first_light:first_light + 20].count("light") == 10
    state = stack.dispatcher.get_state()[0]
    assert state["users"]["heavy"]["queued"] > 0
    # A queued heavy request heard of its position as it moved, not once.
    last = heavy[-1]
    assert (await final(stack, last)).status is R.COMPLETED
    told = queued_statuses(stack, last.request_id)
    moves = [pos for pos, _ in told]
    assert len(moves) >= 3 and moves == sorted(moves, reverse=True) and moves[-1] < moves[0]
    # Every one of them carried a wait estimate (run times are known: the warm request ran), and it
    # shrank as the request moved up.
    waits = [w for _, w in told if w is not None]
    assert len(waits) == len(told) and waits[-1] < waits[0], told


async def test_a_user_past_its_queued_limit_is_refused_at_once_with_the_limit_and_count(
        limited: tuple[Stack, SlowCaller], tmp_path: Any) -> None:
    stack, _ = limited
    mk = await warmed(stack, tmp_path, "other")
    reqs = await submit_all(stack, mk, "heavy", 30)
    finals = [await final(stack, r) for r in reqs]  # every one ends: nothing dropped
    refused = [s for s in finals if s.status is R.ERROR]
    assert refused and all(s.error == "QueueLimitExceeded" and s.limit == 5 and s.count == 5 for s in refused)
    assert "limit is 5" in refused[0].message
    assert sum(s.status is R.COMPLETED for s in finals) >= 5
    other = request(mk, "other:1", user="other")  # type: ignore[arg-type]  # another user is not limited by it
    await stack.serving.submit(other)
    assert (await final(stack, other)).status is R.COMPLETED
    await until(lambda: not stack.serving.requests.stored)  # all acked


class GatedCaller(EchoCaller):
    """Every call waits until `gate` opens; `started` holds each call's users as it starts."""

    def __init__(self, runtime: FakeRuntime) -> None:
        super().__init__(runtime)
        self.gate = asyncio.Event()
        self.started: list[list[str]] = []

    async def run_batch(self, handle: FakeProcess, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        self.started.append(list(users))
        await self.gate.wait()
        return await super().run_batch(handle, payloads, users)


async def test_a_light_users_request_does_not_wait_for_a_lane_held_by_the_flood(tmp_path: Any) -> None:
    """Every lane holds a heavy call: the light user's request (head of the fair queue, nothing of its
    user running) is called at once beyond the lanes, the replica's turns then run it next; the heavy
    user never gets such a call, and there is at most one per ready replica."""
    callers: list[GatedCaller] = []

    def make(runtime: FakeRuntime) -> GatedCaller:
        callers.append(GatedCaller(runtime))
        callers[0].gate.set()  # the warm-up runs at once
        return callers[0]

    async with memory_stack(make, fairness=FairnessPolicy()) as stack:
        caller = callers[0]
        mk = await warmed(stack, tmp_path, "heavy")
        proc = next(iter(stack.dispatcher.processors.values()))
        lanes = proc.lanes_per_replica * len(proc.ready)
        caller.gate.clear()
        caller.started.clear()
        heavy = await submit_all(stack, mk, "heavy", 20)
        await until(lambda: len(caller.started) == lanes and proc.queue.queued("heavy") > 0, timeout=10)
        light = request(mk, "light:0", user="light")  # type: ignore[arg-type]
        await stack.serving.submit(light)
        await until(lambda: ["light"] in caller.started, timeout=10)  # while every lane still waits
        assert len(caller.started) == lanes + 1 and len(proc.express) == 1
        # A second light user finds the one such call per replica taken: it waits in the queue.
        other = request(mk, "other:0", user="other")  # type: ignore[arg-type]
        await stack.serving.submit(other)
        await until(lambda: proc.queue.queued("other") == 1, timeout=10)
        assert len(caller.started) == lanes + 1
        assert all(users != ["heavy"] for users in caller.started[lanes:])
        caller.gate.set()
        for r in [light, other, *heavy]:
            assert (await final(stack, r)).status is R.COMPLETED
        assert not proc.express and stack.dispatcher.get_state()[0]["express_calls"] == 1


class FailingCaller(EchoCaller):
    """A request whose data starts with "fail" fails after what the replica counts as 5 s (its wait
    for a turn included); the others complete in 1 ms."""

    async def run_batch(self, handle: FakeProcess, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        if str(payloads[0].get("data", "")).startswith("fail"):
            return [Failed(error="ExecutionTimeout", message="busy", seconds=5.0)] * len(payloads)
        return await super().run_batch(handle, payloads, users)


async def test_the_run_time_that_sizes_batches_is_taken_from_completed_requests_only(tmp_path: Any) -> None:
    async with memory_stack(FailingCaller) as stack:
        mk = await warmed(stack, tmp_path, "u")
        proc = next(iter(stack.dispatcher.processors.values()))
        before = proc.exec_s
        assert before is not None and before < 0.1
        bad = request(mk, "fail:1", user="u")  # type: ignore[arg-type]
        await stack.serving.submit(bad)
        assert (await final(stack, bad)).status is R.ERROR
        assert proc.exec_s == before  # a failure's 5 s (a wait, not a run) does not shrink the batches
