"""The fuzz of every command and request field (tests/fuzz_inputs.py) at full strength, on the
in-memory ports: the real controller and dispatcher over the memory log and serving ports
(tests/memory_stack.py). The live server's test of the same inputs is
tests/integration/test_fuzz_boundaries.py, which proves the wiring.

Every input gets a clear answer: a command a typed reply (ok, or an error class and a message, with
nothing appended when refused); a request with an id a status can be kept under ends ERROR with a
message; every request leaves the work queue, no consumer is made for it and nothing is appended. No
service stalls: another command is answered within 1 s while each input is handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.service.clock import observed
from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from schemas.commands import CommandResult, ScaleDown
from schemas.events import ModelRegistered
from schemas.keys import canonical_model_key
from schemas.status import RequestStatus
from tests.fuzz_inputs import (
    ANSWER_S,
    BYSTANDER,
    KNOWN,
    command_bodies,
    command_subject_verb,
    header_ids,
    published,
    request_bodies,
    subject_verbs,
)
from tests.memory_stack import Stack, memory_stack
from tests.unit.test_dispatcher_memlog import EchoCaller
from tests.waiting import until

pytestmark = pytest.mark.timeout(300)
FULL = {"deadline": None, "database": None, "suppress_health_check": list(HealthCheck)}


class Rig:
    """Services over the memory ports on one event loop that the (sync) hypothesis tests drive. For
    the commands a controller alone (no node, no autoscale or policy loop: as the live test's, nothing
    appends between a command and the check of what it appended); for the requests the whole stack."""

    def __init__(self, *, stack: bool) -> None:
        self.loop = asyncio.new_event_loop()
        self.exits = contextlib.AsyncExitStack()
        if stack:
            self.stack: Stack = self.run(self.exits.enter_async_context(memory_stack(EchoCaller)))
            self.log, self.controller = self.stack.log, self.stack.controller
        else:
            self.log = MemoryEventLog()
            self.controller = self.run(Controller(Parts(self.log, None), policy_interval_s=3600,
                                                  autoscale_interval_s=3600).start())
            self.exits.push_async_callback(self.controller.stop)
        self.run(self.log.append(
            [observed(ModelRegistered, actor="test", model_key=canonical_model_key(m), checkpoint="/nonexistent",
                      size_bytes=10**6) for m in (KNOWN, BYSTANDER)], None))
        self.other_events = 0  # appended by the commands sent meanwhile

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            self.run(self.exits.aclose())
        finally:
            self.loop.close()

    async def appended(self) -> int:
        return await self.log.last_seq() - self.other_events

    async def answered_meanwhile(self, work: Any) -> Any:
        """Run `work` while another command (a scale-down to the count it has: nothing to do) is
        handled; that one must be answered within ANSWER_S."""

        async def other() -> None:
            t0 = time.perf_counter()
            cmd = ScaleDown(command_id=uuid.uuid4().hex, actor="test", model_key=canonical_model_key(BYSTANDER),
                            replicas=5)
            res = await self.controller.handle(msgspec.json.encode(cmd), verb="scale-down")
            assert res.ok, res
            self.other_events += res.last_seq - res.first_seq + 1 if res.first_seq else 0
            took = time.perf_counter() - t0
            assert took <= ANSWER_S, f"another command took {took:.2f}s while fuzz input was handled"

        return (await asyncio.gather(other(), work))[1]


@contextlib.contextmanager
def running(*, stack: bool) -> Iterator[Rig]:
    r = Rig(stack=stack)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def commands_rig() -> Iterator[Rig]:
    with running(stack=False) as r:
        yield r


@pytest.fixture
def requests_rig() -> Iterator[Rig]:
    with running(stack=True) as r:
        yield r


@settings(max_examples=200, **FULL)
@given(body=command_bodies, verb=subject_verbs)
def test_fuzzed_commands_get_a_clear_answer_and_refusals_append_nothing(commands_rig: Rig, body: bytes,
                                                                       verb: str | None) -> None:
    rig = commands_rig

    async def one() -> None:
        before = await rig.appended()
        res: CommandResult = await rig.answered_meanwhile(
            rig.controller.handle(body, verb=command_subject_verb(body, verb)))
        if not res.ok:
            assert res.error and res.message, res
            assert res.error != "Exception" and not res.message.startswith("controller error"), res  # no crash
            # A refusal appends nothing; a decision that placed nothing (no room) is recorded, and
            # appends exactly the events its result names.
            recorded = res.last_seq - res.first_seq + 1 if res.first_seq and not res.duplicate else 0
            assert recorded == 0 or res.rejections, f"a refusal appended events: {res}"
            assert await rig.appended() == before + recorded, f"refused input appended events: {res}"

    rig.run(one())


@settings(max_examples=150, **FULL)
@given(body=request_bodies, header_id=header_ids, on_own_subject=st.booleans())
def test_fuzzed_requests_end_clearly_and_leave_nothing_behind(requests_rig: Rig, body: bytes, header_id: str | None,
                                                              on_own_subject: bool) -> None:
    rig = requests_rig
    pub = published(body, header_id, on_own_subject)
    subject, headers, rid, keyed = pub.subject, pub.headers, pub.body_id, pub.keyed
    serving = rig.stack.serving

    async def one() -> None:
        before, consumers = await rig.appended(), await serving.requests.consumer_tokens()
        await rig.answered_meanwhile(serving.requests.put(subject, body, headers))
        if keyed is not None and keyed == rid:
            # The status is kept under the body's id (or the header's when the body has none valid).
            await until(lambda: (s := serving.status(keyed)) is not None and s.terminal, timeout=15)
            u = serving.status(keyed)
            assert u is not None and u.status is RequestStatus.ERROR and u.error and u.message, u
        await until(lambda: not serving.requests.stored, timeout=15)  # refused or not, it leaves the work queue
        assert await serving.requests.consumer_tokens() == consumers
        assert await rig.appended() == before

    rig.run(one())
