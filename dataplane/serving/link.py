"""The request path between a dispatcher and a replica: NATS request/reply, with Ray as its fallback.

A Ray actor call costs 1.0-1.6 ms round trip on the reference VM; a NATS request/reply to the same
actor process 0.3 ms (measured side by side, docs/benchmarks.md). So every replica actor also
answers its `run_batch` on the core subject `ndif.run.<ntok>.<mtok>.<replica_id>` (its endpoint, served by
a thread of its own with its own connection), and the dispatcher's lanes call it there. Ray stays
in charge of the actor's life (create, load, cache, kill) and is the fallback:

- no endpoint answers (an actor made without one, or its connection is down): the server's 503
  "no responders" comes back at once, the lane makes the same call through Ray and the endpoint is
  tried again after `RETRY_S`;
- an answer that does not fit in one NATS message (or is not msgpack-able) is parked in the actor
  and taken through Ray (`take_answer`), which carries large objects well;
- an actor that dies under a call never answers: calls older than `CHECK_S` are checked with a Ray
  call (`calls_active`). A dead actor raises `RayActorError` (the requests go back to the queue,
  as with a Ray call); a call the actor does not know at two checks in a row lost its answer on the
  way (`ReplyLost`: back to the queue; execution is at-least-once, the terminal status exactly once).

Messages are dataplane/replica/wire.py's (msgpack): a `Call` in, a `Reply` out (`Answers`, or
`Parked`); the answers are `ModelActor.run_batch`'s, unchanged. The fallback is the `ReplicaCaller`
the link is given (the dispatcher's: the same one its lanes call through).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.js import api

from dataplane.replica.endpoint import CALL_HEADER
from dataplane.replica.wire import HEADROOM_BYTES, Answer, Parked, decode_reply
from dataplane.runtime.ports import ReplicaCaller
from schemas.guard import Refused

logger = structlog.get_logger("ndif.replica_link")

__all__ = ["NoEndpoint", "ReplicaLink", "ReplyLost"]

NO_RESPONDERS = "503"  # the status the server answers a request nobody is subscribed to
RETRY_S = 5.0  # after "no responders", a replica's endpoint is tried again this much later
CHECK_S = 1.0  # calls older than this are checked through Ray (is the actor alive, does it know them)


class NoEndpoint(Exception):
    """Nobody answers on the replica's endpoint: make the call through Ray."""


class ReplyLost(Exception):
    """The replica does not know the call any more and its answer never came: run the requests again."""


# ---- the dispatcher's side -------------------------------------------------------------------


class _Call:
    __slots__ = ("actor", "fut", "key", "reply", "started", "unknown")

    def __init__(self, key: tuple[str, int], actor: Any, reply: str, fut: asyncio.Future[list[Answer]]) -> None:
        self.key = key
        self.actor = actor
        self.reply = reply
        self.fut = fut
        self.started = time.monotonic()
        self.unknown = 0  # checks in a row that found the call unknown to the replica


class ReplicaLink:
    """A dispatcher's calls to replica endpoints: one inbox subscription, answers matched by token.

    `call()` returns a future of the batch's answers (or `NoEndpoint`, `RayActorError`, `ReplyLost`).
    Sending goes through `send(subject, body, reply, headers)`, the dispatcher's ordered outbox, so a call
    never waits on the connection. `caller` is the fallback: it takes parked answers and checks
    whether calls are still known (give it the caller the lanes use).
    """

    def __init__(self, nc: Any, send: Callable[[str, bytes, str, dict[str, str] | None], None],
                 caller: ReplicaCaller) -> None:
        self.nc = nc
        self.caller = caller
        self._send = send
        self._prefix = ""
        self._n = 0
        self._calls: dict[str, _Call] = {}
        self._off: dict[tuple[str, int], float] = {}  # replica -> monotonic time its endpoint is tried again
        self._sub: Any = None
        self._checker: asyncio.Task[None] | None = None
        self._taking: set[asyncio.Future[None]] = set()

    async def start(self) -> ReplicaLink:
        self._prefix = self.nc.new_inbox() + "."
        self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._on_reply)
        self._checker = asyncio.create_task(self._check_loop(), name="replica-link-check")
        return self

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._checker
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for c in list(self._calls.values()):
            c.fut.cancel()

    def usable(self, key: tuple[str, int], body_len: int) -> bool:
        """Go over NATS? Not while the replica's endpoint was found absent lately, nor for a call
        too big for one message."""
        return self._off.get(key, 0.0) <= time.monotonic() and body_len < self.nc.max_payload - HEADROOM_BYTES

    def endpoint_absent(self, key: tuple[str, int]) -> None:
        if self._off.get(key, 0.0) <= time.monotonic():
            logger.info("replica_endpoint_absent", model_key=key[0], replica_id=key[1], retry_s=RETRY_S)
        self._off[key] = time.monotonic() + RETRY_S

    def call(self, key: tuple[str, int], subject: str, actor: Any, body: bytes) -> asyncio.Future[list[Answer]]:
        """Send `body` (a wire `Call`) to the replica's endpoint `subject`; the future of its answers."""
        self._n += 1
        token = str(self._n)
        fut: asyncio.Future[list[Answer]] = asyncio.get_running_loop().create_future()
        self._calls[token] = _Call(key, actor, self._prefix + token, fut)
        fut.add_done_callback(lambda _f: self._calls.pop(token, None))
        # The id travels in a header: across accounts the replica sees another reply subject.
        self._send(subject, body, self._prefix + token, {CALL_HEADER: self._prefix + token})
        return fut

    async def _on_reply(self, msg: Msg) -> None:
        c = self._calls.get(msg.subject[len(self._prefix):])
        if c is None or c.fut.done():
            return
        if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS:
            c.fut.set_exception(NoEndpoint(f"no endpoint for replica {c.key[1]} of {c.key[0]}"))
            return
        reply = decode_reply(msg.data)
        if isinstance(reply, Refused):
            c.fut.set_exception(ReplyLost(f"unreadable answer from replica {c.key[1]}: {reply.reason}"))
            return
        if isinstance(reply, Parked):
            t = asyncio.ensure_future(self._take(c))
            self._taking.add(t)
            t.add_done_callback(self._taking.discard)
        else:
            c.fut.set_result(reply.answers)

    async def _take(self, c: _Call) -> None:
        try:
            answers = await self.caller.take_answer(c.actor, c.reply)
        except Exception as exc:  # noqa: BLE001 - the actor died meanwhile: handled like a Ray call's error
            if not c.fut.done():
                c.fut.set_exception(exc)
            return
        if not c.fut.done():
            if answers is None:
                c.fut.set_exception(ReplyLost(f"the parked answer of replica {c.key[1]} was dropped"))
            else:
                c.fut.set_result(answers)

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await self._check()
            except Exception as exc:  # noqa: BLE001 - a check that fails is tried again next round
                logger.warning("replica_link_check_failed", error=str(exc))

    async def _check(self) -> None:
        old = time.monotonic() - CHECK_S
        by_replica: dict[tuple[str, int], list[_Call]] = {}
        for c in list(self._calls.values()):
            if c.started < old and not c.fut.done():
                by_replica.setdefault(c.key, []).append(c)
        for key, calls in by_replica.items():
            try:
                known = await asyncio.wait_for(self.caller.calls_active(calls[0].actor, [c.reply for c in calls]), 10)
            except TimeoutError:
                continue  # busy or unreachable: asked again next round
            except Exception as exc:
                if not self.caller.gone(exc):
                    raise
                logger.warning("replica_gone_under_calls", model_key=key[0], replica_id=key[1], calls=len(calls))
                for c in calls:
                    if not c.fut.done():
                        c.fut.set_exception(exc)
                continue
            for c, k in zip(calls, known, strict=True):
                c.unknown = 0 if k else c.unknown + 1
                if c.unknown >= 2 and not c.fut.done():
                    logger.warning("replica_answer_lost", model_key=key[0], replica_id=key[1])
                    c.fut.set_exception(ReplyLost(f"the answer of replica {key[1]} of {key[0]} was lost"))
