"""A hypothesis fuzz of every command and request field, published raw to a live server.

Every input gets a clear answer: a command a typed reply (ok, or an error class and a message, with
nothing appended when refused); a request with an id a status can be kept under ends ERROR with a
message, one without is terminated; the request stream is left empty and no consumer is made. No
service stalls: another command is answered within 1 s while each input is handled. The rule at full
strength is tests/unit/test_fuzz_boundaries_memlog.py's (the same inputs on the in-memory ports);
this one proves the wiring, with fewer examples under the `ci` profile (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import nats.js.errors
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.clock import observed
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.serving.dispatcher import Dispatcher
from schemas.commands import CommandResult
from schemas.events import ModelRegistered
from schemas.keys import canonical_model_key
from schemas.requests import status_decoder
from schemas.subjects import REQUEST_STATUS_BUCKET, REQUESTS_STREAM
from tests.conftest import fresh_event_log, live_settings
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

pytestmark = pytest.mark.timeout(600)


class Rig:
    """Controller + dispatcher on one event loop that the (sync) hypothesis test drives."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.run(self._start())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _start(self) -> None:
        self.log: JetStreamEventLog = await fresh_event_log(self.url)
        await self.log.append([observed(ModelRegistered, actor="test", model_key=canonical_model_key(m),
                                        checkpoint="/nonexistent", size_bytes=10**6) for m in (KNOWN, BYSTANDER)],
                              None)
        # no autoscale loop: its decisions would append between a command and the check of what it appended
        self.controller = await Controller.from_url(self.url, name="controller:fuzz", autoscale_interval_s=3600).start()
        self.dispatcher = await Dispatcher.from_url(self.url, name="dispatcher:fuzz").start()
        self.admin = await AdminClient.open(self.url, timeout=10)
        self.kv = await self.log.js.key_value(REQUEST_STATUS_BUCKET)
        self.slowest = 0.0
        self.other_events = 0  # appended by the commands sent meanwhile

    async def _stop(self) -> None:
        await self.admin.close()
        await self.dispatcher.stop()
        await self.controller.stop()
        await self.log.close()

    def close(self) -> None:
        self.run(self._stop())
        pending = asyncio.all_tasks(self.loop)
        for t in pending:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()
        print(f"\nRECORD fuzz: slowest other command while fuzz input was handled: {self.slowest * 1000:.1f} ms")

    async def answered_meanwhile(self, work: Any) -> Any:
        """Run `work` while another command (a scale-down to the count it has: nothing to do) is sent;
        that one must be answered within ANSWER_S."""

        async def other() -> float:
            t0 = time.perf_counter()
            res = await self.admin.scale_down(BYSTANDER, 5)  # (a fuzzed undeploy may forget KNOWN)
            assert res.ok, res
            # Every command's id is recorded (CommandDecided), a no-op's too: those are its events, not the input's.
            self.other_events += res.last_seq - res.first_seq + 1 if res.first_seq else 0
            return time.perf_counter() - t0

        took, out = await asyncio.gather(other(), work)
        self.slowest = max(self.slowest, took)
        assert took <= ANSWER_S, f"another command took {took:.2f}s while fuzz input was handled"
        return out


@pytest.fixture(scope="module")
def rig(nats_server: EmbeddedNats) -> Iterator[Rig]:
    r = Rig(nats_server.url)
    try:
        yield r
    finally:
        r.close()


@live_settings(200, suppress_health_check=list(HealthCheck))
@given(body=command_bodies, verb=subject_verbs)
def test_fuzzed_commands_get_a_clear_answer_and_refusals_append_nothing(rig: Rig, body: bytes, verb: str | None) -> None:
    subject = f"ndif.cmd.{command_subject_verb(body, verb)}"

    async def one() -> None:
        before = await rig.log.last_seq() - rig.other_events
        raw = await rig.answered_meanwhile(rig.log.nc.request(subject, body, timeout=5))
        res = msgspec.json.decode(raw.data, type=CommandResult)
        if not res.ok:
            assert res.error and res.message, res
            assert res.error != "Exception" and not res.message.startswith("controller error"), res  # no crash
            # A refusal appends nothing; a decision that placed nothing (no room: exit 7) is recorded,
            # and appends exactly the events its result names.
            recorded = res.last_seq - res.first_seq + 1 if res.first_seq and not res.duplicate else 0
            assert recorded == 0 or res.rejections, f"a refusal appended events: {res}"
            assert await rig.log.last_seq() - rig.other_events == before + recorded, f"refused input appended events: {res}"

    rig.run(one())


@live_settings(150, suppress_health_check=list(HealthCheck))
@given(body=request_bodies, header_id=header_ids, on_own_subject=st.booleans())
def test_fuzzed_requests_end_clearly_and_leave_nothing_behind(rig: Rig, body: bytes, header_id: str | None,
                                                              on_own_subject: bool) -> None:
    pub = published(body, header_id, on_own_subject)
    subject, headers, rid, keyed = pub.subject, pub.headers, pub.body_id, pub.keyed

    async def one() -> None:
        before = await rig.log.last_seq() - rig.other_events
        try:
            ack = await rig.answered_meanwhile(rig.log.js.publish(subject, body, headers=headers))
        except nats.js.errors.APIError:
            return  # refused by the server (e.g. a header id it rejects): nothing stored
        if ack.duplicate:
            return  # the same Nats-Msg-Id within the dedup window (hypothesis repeats inputs): not stored again
        if keyed is not None and keyed == rid:
            # The status is kept under the body's id (or the header's when the body has none valid).
            async with asyncio.timeout(15):
                while True:
                    try:
                        u = status_decoder.decode((await rig.kv.get(keyed)).value)
                        if u.terminal:
                            break
                    except nats.js.errors.KeyNotFoundError:
                        pass
                    await asyncio.sleep(0.02)
            assert u.status.value == "ERROR" and u.error and u.message, u
        async with asyncio.timeout(15):  # refused or not, it leaves the work queue
            while (await rig.log.js.stream_info(REQUESTS_STREAM)).state.messages:
                await asyncio.sleep(0.05)
        assert [c.name for c in await rig.log.js.consumers_info(REQUESTS_STREAM)] == []
        assert await rig.log.last_seq() - rig.other_events == before

    rig.run(one())
