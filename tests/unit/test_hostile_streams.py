"""Hostile bytes, as many and as mixed as Hypothesis makes them, stop no service of the in-memory
stack (tests/memory_stack.py: the controller, a node's agent, the dispatcher; the dashboard beside
them), on either of the streams an outsider can write to.

- The event log: bodies an agent can append on its own subjects (nesting thousands deep, invalid
  UTF-8 inside strings, real events cut or flipped, unknown types), between valid events. Every
  service's fold moves past each one, counts it, and applies the valid events; no task dies.
- The request stream: bodies a user can publish on a model's subject. Each ends ERROR with the
  reason (under its id where one can be read) and leaves the queue; the valid request behind them
  is served.

One stack serves every example (started once, on one event loop), so what one example leaves
behind is what the next one meets.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Coroutine, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.dashboard import Dashboard
from controlplane.service.parts import Parts
from dataplane.serving.dispatcher.intake import _id_of
from schemas import events as E
from schemas.keys import canonical_model_key
from schemas.requests import Request
from schemas.status import RequestStatus
from schemas.subjects import node_subject, node_token, replica_subject, request_subject
from tests.memory_stack import NODE, Stack, memory_stack
from tests.strategies import any_event, hostile_bytes
from tests.unit.test_dispatcher_memlog import EchoCaller
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)
few = settings(max_examples=25, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_n = itertools.count()


class Running:
    """The memory stack and a dashboard, started once on their own event loop; each example runs on it."""

    def __init__(self, root: Path) -> None:
        (root / "config.json").write_text("{}")
        self.model = canonical_model_key(str(root), relative=False)
        self.loop = asyncio.new_event_loop()
        self.exits = contextlib.AsyncExitStack()
        self.stack: Stack = self.run(self.exits.enter_async_context(memory_stack(EchoCaller)))
        self.dash: Dashboard = self.run(self.exits.enter_async_context(Dashboard(Parts(self.stack.log, None), port=0)))

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def tasks(self) -> list[asyncio.Task[None]]:
        s = self.stack
        return [*s.controller._tasks, *s.agent._tasks, *s.dispatcher._tasks, *self.dash._tasks]

    def folds(self) -> list[Any]:
        s = self.stack
        return [s.controller.state, s.agent.state, s.dispatcher.state, self.dash.model.live]

    def close(self) -> None:
        try:
            self.run(self.exits.aclose())
        finally:
            self.loop.close()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    r = Running(tmp_path)
    try:
        yield r
    finally:
        r.close()


ONE_SHOT = {"agent-rejoin"}  # tasks that end once their work is done; every other runs till stopped


def alive(r: Running) -> None:
    dead = [t.get_name() for t in r.tasks() if t.done() and (t.get_name() not in ONE_SHOT or t.cancelled()
                                                             or t.exception() is not None)]
    assert not dead, f"tasks ended: {dead}"


# ---- the event log ----------------------------------------------------------------------------


@st.composite
def unknown_type(draw: st.DrawFn) -> bytes:
    """A well-formed event of a type this version does not know (a newer writer's, or a forger's)."""
    body = msgspec.json.decode(E.encode_event(draw(any_event())))
    body["type"] = draw(st.sampled_from(["ReplicaTeleported", "", "NodeJoined2", "x" * 300]))
    return msgspec.json.encode(body)


AGENT_SUBJECTS = [node_subject(NODE), f"{replica_subject('m', 0)}.{node_token(NODE)}"]
hostile_item = st.tuples(st.sampled_from(AGENT_SUBJECTS), hostile_bytes | unknown_type())
# None: a valid event (a node joins) at this point of the log
log_items = st.lists(st.one_of(hostile_item, st.none()), min_size=1, max_size=12)


def test_every_service_reads_past_hostile_events_and_applies_the_valid_ones(running: Running) -> None:
    r, log = running, running.stack.log

    @few
    @given(log_items)
    def example(items: list[tuple[str, bytes] | None]) -> None:
        before = [f.skipped for f in r.folds()]
        skipped, joined = 0, []
        for item in items:
            if item is None:
                node = f"node-v{next(_n)}"
                ev = E.NodeJoined(event_id=f"join-{uuid.uuid4().hex}", ts=datetime.now(UTC), actor=f"agent:{node}",
                                  node_id=node, cpu_cache_bytes=0, gpus=())
                r.run(log.append([ev], None))
                joined.append(node)
            else:
                subject, body = item
                r.run(log.append_raw(subject, body, f"hostile-{next(_n)}", datetime.now(UTC)))
                skipped += isinstance(E.stored_item(subject, body), E.Skipped)
        last = r.run(log.last_seq())
        r.run(until(lambda: min(f.seq for f in r.folds()) >= last, timeout=10))
        for fold, was in zip(r.folds(), before, strict=True):
            assert fold.seq >= last
            assert fold.skipped - was == skipped, (type(fold).__name__, fold.skipped - was, skipped)
            assert all(n in fold.nodes for n in joined), joined
        alive(r)

    example()
    # Their jobs go on after all of it: a request deploys its model, the agent loads it, it is served.
    req = Request(request_id="after-hostile-log", model_key=r.model, payload={"op": "echo", "data": 7},
                  submitted_at=datetime.now(UTC))
    r.run(r.stack.serving.submit(req))
    r.run(until(lambda: (s := r.stack.serving.status(req.request_id)) is not None and s.terminal, timeout=20))
    done = r.stack.serving.status(req.request_id)
    assert done is not None and done.status is RequestStatus.COMPLETED and done.result["echo"] == 7, done
    alive(r)


# ---- the request stream -----------------------------------------------------------------------

hostile_requests = st.lists(st.tuples(hostile_bytes, st.sampled_from(["", "alice"])), min_size=1, max_size=6)


def test_every_hostile_request_ends_with_a_reason_and_the_valid_one_behind_it_is_served(running: Running) -> None:
    r, serving = running, running.stack.serving

    @few
    @given(hostile_requests)
    def example(bodies: list[tuple[bytes, str]]) -> None:
        ends: list[tuple[str, str]] = []  # (request id, user) each hostile body's ERROR is kept under
        for body, user in bodies:
            headers = {"Nats-Msg-Id": f"{user}.memory.bad-{next(_n)}" if user else f"bad-{next(_n)}"}
            r.run(serving.requests.put(request_subject(r.model, user or None), body, headers))
            rid = _id_of(body, headers)
            assert rid is not None  # the header's id, when the body names none
            ends.append((rid, user))
        good = Request(request_id=f"good-{next(_n)}", model_key=r.model, payload={"op": "echo", "data": 1},
                       submitted_at=datetime.now(UTC), user="alice")
        r.run(serving.submit(good))
        r.run(until(lambda: (s := serving.status(good.request_id, "alice")) is not None and s.terminal, timeout=20))
        served = serving.status(good.request_id, "alice")
        assert served is not None and served.status is RequestStatus.COMPLETED, served
        for rid, user in ends:
            got = serving.status(rid, user)
            assert got is not None and got.status is RequestStatus.ERROR and got.error and got.message, (rid, got)
        r.run(until(lambda: not serving.requests.stored, timeout=10))  # every one acked or deleted: none redelivered
        alive(r)

    example()
