"""The replica link (dataplane/serving/link.py) falls back on the caller it is given, and the dispatcher
gives it its own: parked answers are taken, and forgotten calls found, through that caller.

No NATS server here: `Bus` routes the link's subjects in process (a reply to nobody gets the
server's 503 "no responders"); tests/dataplane/test_replica_link.py runs the link on a real server
with real Ray actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.aio.msg import Msg

from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from dataplane.replica.wire import Answer, Answers, Call, Completed, Parked, decode_call, encode_call, encode_reply
from dataplane.serving import link as link_module
from dataplane.serving.dispatcher import Dispatcher
from dataplane.serving.link import NoEndpoint, ReplicaLink, ReplyLost
from dataplane.serving.memory import MemoryServing
from schemas.commands import CommandResult
from schemas.subjects import subject_matches

pytestmark = pytest.mark.timeout(30)
Callback = Callable[[Msg], Awaitable[None]]


class Sub:
    def __init__(self, bus: Bus, subject: str, cb: Callback) -> None:
        self.bus, self.subject, self.cb = bus, subject, cb

    async def unsubscribe(self) -> None:
        if self in self.bus.subs:
            self.bus.subs.remove(self)


class Bus:
    """What the link and the dispatcher use of a NATS connection, routed in process."""

    max_payload = 1 << 20
    is_connected = True

    def __init__(self) -> None:
        self.subs: list[Sub] = []
        self._n = 0

    def new_inbox(self) -> str:
        self._n += 1
        return f"_INBOX.test{self._n}"

    async def subscribe(self, subject: str, cb: Callback, **_: Any) -> Sub:
        sub = Sub(self, subject, cb)
        self.subs.append(sub)
        return sub

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        targets = [s for s in self.subs if subject_matches(subject, s.subject)]
        if not targets and reply:
            await self.publish(reply, b"", headers={"Status": "503"})  # the server's "no responders"
            return
        for s in targets:
            await s.cb(Msg(_client=None, subject=subject, reply=reply, data=payload, headers=headers))  # type: ignore[arg-type]

    def send(self, subject: str, body: bytes, reply: str, headers: dict[str, str] | None = None) -> None:
        """The dispatcher's outbox: publish without waiting."""
        asyncio.get_running_loop().create_task(self.publish(subject, body, reply, headers))


class Gone(Exception):
    """The replica's process died (what `RayActorError` is to the Ray caller)."""


class RecordingCaller:
    """A `ReplicaCaller` that records what it is asked; answers parked in `parked` by reply subject."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, Any, Any]] = []
        self.parked: dict[str, list[Answer]] = {}
        self.known: set[str] = set()  # calls the replica still knows
        self.dead = False

    def lookup(self, model_key: str, replica_id: int) -> Any:
        return f"handle:{model_key}:{replica_id}"

    async def run_batch(self, handle: Any, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        self.asked.append(("run_batch", handle, payloads))
        return [Completed(result=p, seconds=0.0) for p in payloads]

    async def take_answer(self, handle: Any, reply: str) -> list[Answer] | None:
        self.asked.append(("take_answer", handle, reply))
        return self.parked.pop(reply, None)

    async def calls_active(self, handle: Any, replies: list[str]) -> list[bool]:
        self.asked.append(("calls_active", handle, tuple(replies)))
        if self.dead:
            raise Gone("the replica's process is gone")
        return [r in self.known for r in replies]

    def gone(self, exc: BaseException) -> bool:
        return isinstance(exc, Gone)


def endpoint(bus: Bus, caller: RecordingCaller, *, park: bool = False, body: bytes | None = None) -> Callback:
    """A replica endpoint: echoes each payload, or parks the answers with `caller`, or answers `body`."""

    async def on_call(msg: Msg) -> None:
        call = decode_call(msg.data)
        assert isinstance(call, Call), call
        answers: list[Answer] = [Completed(result=p, seconds=0.001) for p in call.payloads]
        if park:
            caller.parked[msg.reply] = answers
        out = body if body is not None else encode_reply(Parked() if park else Answers(answers=answers))
        await bus.publish(msg.reply, out)

    return on_call


async def _link(bus: Bus, caller: RecordingCaller) -> ReplicaLink:
    return await ReplicaLink(bus, bus.send, caller).start()


async def test_parked_answers_are_taken_through_the_given_caller() -> None:
    bus, caller = Bus(), RecordingCaller()
    await bus.subscribe("ndif.run.n.m.0", endpoint(bus, caller))
    await bus.subscribe("ndif.run.n.m.1", endpoint(bus, caller, park=True))
    link = await _link(bus, caller)
    try:
        small = await link.call(("m", 0), "ndif.run.n.m.0", "actor-0", encode_call([{"data": 1}]))
        assert small == [Completed(result={"data": 1}, seconds=0.001)] and caller.asked == []
        big = await link.call(("m", 1), "ndif.run.n.m.1", "actor-1", encode_call([{"data": 2}]))
        assert big == [Completed(result={"data": 2}, seconds=0.001)]
        ((what, handle, reply),) = caller.asked
        assert (what, handle) == ("take_answer", "actor-1") and reply.startswith("_INBOX.test")
    finally:
        await link.stop()


async def test_a_dropped_parked_answer_or_an_unreadable_one_is_lost_and_no_endpoint_is_known_at_once() -> None:
    bus, caller = Bus(), RecordingCaller()
    link = await _link(bus, caller)
    try:
        sub = await bus.subscribe("ndif.run.n.m.0", endpoint(bus, caller, body=encode_reply(Parked())))
        with pytest.raises(ReplyLost, match="dropped"):  # parked, but the replica no longer has it
            await link.call(("m", 0), "ndif.run.n.m.0", "actor-0", encode_call([{}]))
        await sub.unsubscribe()
        sub = await bus.subscribe("ndif.run.n.m.0", endpoint(bus, caller, body=b"\x92\x00\x90"))  # the old tuple form
        with pytest.raises(ReplyLost, match="unreadable"):
            await link.call(("m", 0), "ndif.run.n.m.0", "actor-0", encode_call([{}]))
        await sub.unsubscribe()
        with pytest.raises(NoEndpoint):
            await link.call(("m", 0), "ndif.run.n.m.0", "actor-0", encode_call([{}]))
    finally:
        await link.stop()


async def test_calls_the_replica_forgot_are_lost_and_a_dead_replicas_fail_through_the_caller(monkeypatch) -> None:
    monkeypatch.setattr(link_module, "CHECK_S", 0.05)
    bus, caller = Bus(), RecordingCaller()

    async def swallow(_msg: Msg) -> None:
        return None  # took the call, never answers

    await bus.subscribe("ndif.run.n.m.>", swallow)
    link = await _link(bus, caller)
    try:
        with pytest.raises(ReplyLost, match="lost"):
            await asyncio.wait_for(link.call(("m", 0), "ndif.run.n.m.0", "actor-0", encode_call([{}])), 5)
        assert {(w, h) for w, h, _ in caller.asked} == {("calls_active", "actor-0")}
        known = link.call(("m", 1), "ndif.run.n.m.1", "actor-1", encode_call([{}]))
        await asyncio.sleep(0.01)
        caller.known = {c.reply for c in link._calls.values()}  # the replica works on it ...
        await asyncio.sleep(0.3)
        assert not known.done()
        caller.dead = True  # ... until its process dies under the call
        with pytest.raises(Gone):
            await asyncio.wait_for(known, 5)
    finally:
        await link.stop()


async def test_the_dispatchers_link_falls_back_on_the_dispatchers_caller() -> None:
    """The dispatcher is given a caller; its replica link must use that one, not make its own."""
    bus, caller = Bus(), RecordingCaller()

    async def no_deploy(model_key: str, replicas: int) -> CommandResult:
        raise AssertionError("nothing is deployed here")

    # Requests and statuses in memory; its publishes (the link's calls among them) on its connection.
    ports = dataclasses.replace(MemoryServing(no_deploy).ports(), publish=bus.publish)
    disp = await Dispatcher(Parts(MemoryEventLog(), bus), caller=caller, ports=ports).start()  # type: ignore[arg-type]
    try:
        assert disp.link is not None and disp.link.caller is caller
        await bus.subscribe("ndif.run.n.m.0", endpoint(bus, caller, park=True))
        got = await disp.link.call(("m", 0), "ndif.run.n.m.0", "actor-0", encode_call([{"data": 3}]))
        assert got == [Completed(result={"data": 3}, seconds=0.001)]
        assert [(w, h) for w, h, _ in caller.asked] == [("take_answer", "actor-0")]
    finally:
        await disp.stop()
