"""The dispatcher over the in-memory log and the in-memory serving ports (dataplane/serving/memory.py),
with the real controller and node agent beside it (no NATS, no Ray, no torch).

It follows the log, provisions a model its first request asks for, serves it once the agent has
loaded a replica, keeps the terminal status and acks the request; a model no node could hold ends
its requests at once; a draining replica with nothing in flight is reported drained by it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from dataplane.replica.wire import Answer, Completed, NotRun
from schemas import events as E
from schemas.commands import Deploy, Evict, Restart
from schemas.keys import canonical_model_key
from schemas.requests import Request, StatusUpdate, status_or_none
from schemas.status import DrainReason, ReplicaState, RequestStatus
from schemas.subjects import subject_matches
from tests.fake_runtime import FakeProcess, FakeRuntime
from tests.memory_stack import GB, NODE, Stack, memory_stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)
R = RequestStatus


class EchoCaller:
    """`ReplicaCaller` over tests/fake_runtime.py's processes: a HOT one echoes each payload."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.calls = 0

    def lookup(self, model_key: str, replica_id: int) -> FakeProcess | None:
        return self.runtime.processes.get((model_key, replica_id))

    async def run_batch(self, handle: FakeProcess, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        self.calls += 1
        if handle.level != "HOT":
            return [NotRun(reason=f"replica is {handle.level}")] * len(payloads)
        return [Completed(result={"echo": p.get("data"), "replica_id": handle.spec.replica_id, "user": u},
                          seconds=0.001) for p, u in zip(payloads, users, strict=True)]

    async def take_answer(self, handle: FakeProcess, reply: str) -> list[Answer] | None:
        raise AssertionError("no replica link without NATS")

    async def calls_active(self, handle: FakeProcess, replies: list[str]) -> list[bool]:
        raise AssertionError("no replica link without NATS")

    def gone(self, exc: BaseException) -> bool:
        return False


@pytest_asyncio.fixture
async def stack(tmp_path) -> AsyncIterator[Stack]:
    async with memory_stack(EchoCaller) as s:
        yield s


def checkpoint(root, name: str) -> str:
    (root / name).mkdir()
    (root / name / "config.json").write_text("{}")
    return canonical_model_key(str(root / name), relative=False)


def request(model_key: str, data: int, user: str = "") -> Request:
    return Request(request_id=f"req-{uuid.uuid4().hex[:12]}", model_key=model_key, payload={"op": "echo", "data": data},
                   submitted_at=datetime.now(UTC), user=user)


async def final(stack: Stack, r: Request) -> StatusUpdate:
    """The request's terminal status, once kept."""
    await until(lambda: (s := stack.serving.status(r.request_id, r.user)) is not None and s.terminal, timeout=10)
    done = stack.serving.status(r.request_id, r.user)
    assert done is not None
    return done


async def test_the_first_request_deploys_the_model_and_is_served_once_a_replica_is_loaded(stack: Stack,
                                                                                          tmp_path) -> None:
    mk = checkpoint(tmp_path, "tiny")
    first = request(mk, 1)
    await stack.serving.submit(first)
    done = await final(stack, first)
    assert done.status is R.COMPLETED and done.result == {"echo": 1, "replica_id": 0, "user": ""}
    # Deployed by the dispatcher's own deploy, loaded by the agent, served through the caller.
    (scheduled,) = stack.events(E.ReplicaScheduled)
    assert scheduled.model_key == mk and scheduled.command_id.startswith("cmd-")
    assert stack.events(E.ReplicaLoaded) and stack.dispatcher.processors
    assert stack.serving.requests.stored == {} and stack.serving.requests.settled == [1]  # acked
    # Statuses went out as published too: the first one while the model was being deployed.
    published = [msgspec.json.decode(b)["status"] for s, b in stack.serving.published
                 if subject_matches(s, "ndif.status.*")]
    assert published[0] == "PROVISIONING" and "COMPLETED" not in published  # the terminal one: the KV's own
    # A second request and one of another user: the model is known, its processor takes them at once.
    more = [request(mk, 2), request(mk, 3, user="alice")]
    for r in more:
        await stack.serving.submit(r)
    assert [(await final(stack, r)).result["echo"] for r in more] == [2, 3]
    assert (await final(stack, more[1])).result["user"] == "alice"  # the call names whose each is (turns)
    assert len(stack.events(E.ReplicaScheduled)) == 1  # deployed once


async def test_a_model_no_node_can_hold_ends_its_requests_at_once(stack: Stack, tmp_path) -> None:
    mk = checkpoint(tmp_path, "huge")
    stack.sizes[mk] = 10_000 * GB
    reqs = [request(mk, i) for i in range(3)]
    for r in reqs:
        await stack.serving.submit(r)
    for r in reqs:
        s = await final(stack, r)
        assert s.status is R.ERROR and s.error == "PlacementImpossible", s
    assert not stack.events(E.ReplicaScheduled)
    await until(lambda: not stack.serving.requests.stored)  # every one acked: nothing redelivered


async def test_a_draining_replica_with_nothing_in_flight_is_reported_drained_by_the_dispatcher(stack: Stack,
                                                                                                tmp_path) -> None:
    mk = checkpoint(tmp_path, "tiny")
    r = request(mk, 1)
    await stack.serving.submit(r)
    assert (await final(stack, r)).status is R.COMPLETED
    res = await stack.controller.handle(msgspec.json.encode(Evict(command_id="evict-1", model_key=mk, replica_id=0)),
                                        verb="evict")
    assert res.ok, res
    # The agent waits 30 s for the report; the dispatcher, following the log, sends it at once.
    await until(lambda: bool(stack.events(E.ReplicaDrained)), timeout=10)
    (drained,) = stack.events(E.ReplicaDrained)
    assert drained.actor == "dispatcher:unit" and drained.replica_id == 0
    await until(lambda: stack.agent.state.replicas[(mk, 0)].state is ReplicaState.CACHED, timeout=10)
    processor = next(iter(stack.dispatcher.processors.values()))
    await until(lambda: not processor.ready and not processor.lanes)  # its lanes retired with the replica


async def test_a_replica_no_dispatcher_serves_drains_at_once_not_after_the_drain_timeout(stack: Stack,
                                                                                        tmp_path) -> None:
    """A model deployed but never requested: no dispatcher calls its replica, so nothing can be in
    flight; evicting it is over in well under the agent's 30 s drain timeout, and says why."""
    mk = checkpoint(tmp_path, "never-asked")
    res = await stack.controller.handle(msgspec.json.encode(Deploy(command_id="d-quiet", model_key=mk, size_bytes=GB)),
                                        verb="deploy")
    assert res.ok, res
    await until(lambda: (r := stack.agent.state.replicas.get((mk, 0))) is not None and r.state is ReplicaState.AVAILABLE,
                timeout=10)
    t0 = time.monotonic()
    res = await stack.controller.handle(msgspec.json.encode(Evict(command_id="evict-q", model_key=mk, replica_id=0)),
                                        verb="evict")
    assert res.ok, res
    await until(lambda: stack.agent.state.replicas[(mk, 0)].state is ReplicaState.CACHED, timeout=10)
    assert time.monotonic() - t0 < 5  # the drain timeout is 30 s
    (drained,) = [e for e in stack.events(E.ReplicaDrained) if e.model_key == mk]
    assert drained.actor == f"agent:{NODE}" and drained.reason is DrainReason.UNSERVED
    assert not [e for e in stack.events(E.ReplicaServed) if e.model_key == mk]


async def test_a_replica_a_dispatcher_serves_waits_for_it_and_its_claim_comes_before_its_first_call(
        stack: Stack, tmp_path) -> None:
    mk = checkpoint(tmp_path, "asked")
    r = request(mk, 1)
    await stack.serving.submit(r)
    assert (await final(stack, r)).status is R.COMPLETED
    (claim,) = stack.events(E.ReplicaServed)
    assert claim.actor == "dispatcher:unit" and claim.replica_id == 0
    assert stack.agent.state.replicas[(mk, 0)].served_by == ("dispatcher:unit",)
    await stack.controller.handle(msgspec.json.encode(Evict(command_id="evict-a", model_key=mk, replica_id=0)),
                                  verb="evict")
    await until(lambda: stack.agent.state.replicas[(mk, 0)].state is ReplicaState.CACHED, timeout=10)
    (drained,) = stack.events(E.ReplicaDrained)
    assert drained.actor == "dispatcher:unit" and drained.reason is DrainReason.IDLE


async def test_requests_for_a_model_whose_every_load_failed_end_with_what_to_do(stack: Stack, tmp_path) -> None:
    """A request must not wait for ever: once every replica the model should have failed to load
    (nothing restarts those but an operator), the queued requests and the ones after end ERROR."""
    mk = checkpoint(tmp_path, "broken")
    stack.runtime.fail_loads = lambda key: key == mk
    first = request(mk, 1)
    await stack.serving.submit(first)
    done = await final(stack, first)
    assert done.status is R.ERROR and done.error == "ModelLoadFailed", done
    assert "ndif restart" in (done.message or "") and "ndif status" in (done.message or ""), done.message
    assert stack.events(E.ReplicaLoadFailed)
    later = request(mk, 2)
    await stack.serving.submit(later)
    assert (await final(stack, later)).error == "ModelLoadFailed"
    await until(lambda: not stack.serving.requests.stored)  # every one acked: nothing redelivered
    # Loads that work again after a restart: the next request is served.
    stack.runtime.fail_loads = lambda key: False
    (failed,) = {e.replica_id for e in stack.events(E.ReplicaLoadFailed)}
    res = await stack.controller.handle(msgspec.json.encode(Restart(command_id="cmd-restart", actor="cli:test", model_key=mk,
                                                             replica_id=failed)), verb="restart")
    assert res.ok, res
    again = request(mk, 3)
    await stack.serving.submit(again)
    assert (await final(stack, again)).status is R.COMPLETED


async def test_an_outcome_the_full_store_cannot_keep_ends_the_request_storage_full_once(stack: Stack,
                                                                                        tmp_path) -> None:
    """A terminal status the full store refuses: the request ends once, ERROR StorageFull with the
    outcome it had, said live (nothing can be kept), and is acked, not run again."""
    mk = checkpoint(tmp_path, "tiny")
    first = request(mk, 1)
    await stack.serving.submit(first)
    assert (await final(stack, first)).status is R.COMPLETED
    caller = stack.dispatcher.caller
    calls = caller.calls
    stack.serving.statuses.full = True
    r = request(mk, 2, user="alice")
    seq = await stack.serving.submit(r)

    def said() -> list[StatusUpdate]:
        return [u for s, b in stack.serving.published if subject_matches(s, "ndif.status.>")
                and (u := status_or_none(b)) is not None and u.request_id == r.request_id and u.terminal]

    await until(lambda: bool(said()) and seq in stack.serving.requests.settled, timeout=10)
    (end,) = said()
    assert end.status is R.ERROR and end.error == "StorageFull" and "(COMPLETED) could not be kept" in (end.message or "")
    await asyncio.sleep(2.5)  # a request not acked is delivered again after ack_wait (1 s)
    assert caller.calls == calls + 1 and len(said()) == 1 and stack.serving.requests.stored == {}
