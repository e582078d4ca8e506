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

Messages are msgpack (`[payload, ...]` in; `[ANSWERS, [answer, ...]]` or `[PARKED, null]` out) and
the answers are `ModelActor.run_batch`'s, unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import api

from controlplane.auth import Creds
from controlplane.eventstore import connect
from dataplane.runtime.ports import ReplicaCaller

logger = structlog.get_logger("ndif.replica_link")

ANSWERS, PARKED = 0, 1
NO_RESPONDERS = "503"  # the status the server answers a request nobody is subscribed to
CHECK_S = 1.0  # calls older than this are checked through Ray (is the actor alive, does it know them)
RETRY_S = 5.0  # after "no responders", a replica's endpoint is tried again this much later
PARKED_MAX = 16  # answers an actor keeps for the dispatchers to take through Ray (oldest dropped) ...
PARKED_TTL_S = 60.0  # ... and for how long (a dispatcher takes one at once; one that died never will)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class NoEndpoint(Exception):
    """Nobody answers on the replica's endpoint: make the call through Ray."""


class ReplyLost(Exception):
    """The replica does not know the call any more and its answer never came: run the requests again."""


# ---- the actor's side ------------------------------------------------------------------------


class ReplicaEndpoint:
    """Serves `run_batch` on a replica's subject, from a thread (and connection) of its own.

    The batches run in a small pool, not on the endpoint's loop, so a long generation never holds
    up the connection (pings, other lanes' calls). Connecting never blocks the actor: until it is
    connected the dispatchers get "no responders" and use Ray.
    """

    def __init__(self, url: str, subject: str, run_batch: Callable[[list[Any]], list[Any]], *,
                 name: str = "ndif-replica", threads: int = 4, max_answer_bytes: int | None = None,
                 creds: Creds | None = None, **log_fields: Any) -> None:
        self.url = url
        self.creds = creds  # the node agent's user: it may serve its own node's `ndif.run.<ntok>.>`
        self.logger = logger.bind(subject=subject, **log_fields)
        self.subject = subject
        self.name = name
        self.max_answer_bytes = max_answer_bytes
        self._run_batch = run_batch
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ndif-endpoint-run")
        self._loop = asyncio.new_event_loop()
        self._active: set[str] = set()  # reply subjects of the calls being answered
        self._parked: collections.OrderedDict[str, tuple[float, list[Any]]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._tasks: set[asyncio.Future[Any]] = set()
        self.nc: Any = None
        self.started = time.monotonic()

    def start(self) -> ReplicaEndpoint:
        self.started = time.monotonic()
        threading.Thread(target=self._loop.run_forever, name="ndif-endpoint", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._connect(), self._loop)
        return self

    async def _connect(self) -> None:
        while True:
            try:
                self.nc = await connect(self.url, name=self.name, creds=self.creds)
                await self.nc.subscribe(self.subject, cb=self._on_call)
                await self.nc.flush()
                self._subscribed.set()
                self.logger.info("replica_endpoint_ready")
                return
            except Exception as exc:  # noqa: BLE001 - NATS not reachable yet: Ray serves meanwhile
                self.logger.warning("replica_endpoint_unavailable", error=str(exc), retry_s=RETRY_S)
                if self.nc is not None:
                    with contextlib.suppress(Exception):
                        await self.nc.close()
                await asyncio.sleep(RETRY_S)

    def ready(self, timeout: float = 10.0) -> bool:
        """Wait (at most `timeout` s) until the endpoint is subscribed."""
        deadline = time.monotonic() + timeout
        while not (self._subscribed.is_set() and self.nc.is_connected):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))
        return True

    async def _on_call(self, msg: Msg) -> None:
        if not msg.reply:
            return
        self._active.add(msg.reply)
        t = asyncio.ensure_future(self._serve(msg))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Msg) -> None:
        try:
            requests = _dec.decode(msg.data)
            answers = await self._loop.run_in_executor(self._pool, self._run_batch, requests)
            try:
                body = _enc.encode((ANSWERS, answers))
            except (TypeError, msgspec.EncodeError):
                body = b""  # not msgpack-able: through Ray (pickle)
            limit = self.max_answer_bytes or (self.nc.max_payload - 4096)
            if not body or len(body) > limit:
                with self._lock:
                    now = time.monotonic()
                    self._parked[msg.reply] = (now, answers)
                    while len(self._parked) > PARKED_MAX or next(iter(self._parked.values()))[0] < now - PARKED_TTL_S:
                        self._parked.popitem(last=False)
                body = _enc.encode((PARKED, None))
            await self.nc.publish(msg.reply, body)
        except Exception as exc:  # noqa: BLE001 - unanswered: the dispatcher's check finds it lost
            self.logger.error("replica_endpoint_call_failed", error=str(exc))
        finally:
            self._active.discard(msg.reply)

    def calls_active(self, replies: list[str]) -> list[bool]:
        """Which of these calls this replica still works on (or keeps a parked answer of)."""
        return [r in self._active or r in self._parked for r in replies]

    def take_answer(self, reply: str) -> list[Any] | None:
        with self._lock:
            kept = self._parked.pop(reply, None)
        return None if kept is None else kept[1]

    def close(self) -> None:
        async def _close() -> None:
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await self.nc.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown(wait=False)


# ---- the dispatcher's side -------------------------------------------------------------------


class _Call:
    __slots__ = ("actor", "fut", "key", "reply", "started", "unknown")

    def __init__(self, key: tuple[str, int], actor: Any, reply: str, fut: asyncio.Future[list[Any]]) -> None:
        self.key = key
        self.actor = actor
        self.reply = reply
        self.fut = fut
        self.started = time.monotonic()
        self.unknown = 0  # checks in a row that found the call unknown to the replica


class ReplicaLink:
    """A dispatcher's calls to replica endpoints: one inbox subscription, answers matched by token.

    `call()` returns a future of the batch's answers (or `NoEndpoint`, `RayActorError`, `ReplyLost`).
    Sending goes through `send(subject, body, reply)`, the dispatcher's ordered outbox, so a call
    never waits on the connection.
    """

    def __init__(self, nc: Any, send: Callable[[str, bytes, str], None], caller: ReplicaCaller | None = None) -> None:
        self.nc = nc
        if caller is None:
            from dataplane.runtime.ray_adapter import RayCaller

            caller = RayCaller()
        self.caller = caller  # the fallback: parked answers, and whether calls are still known
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
        return self._off.get(key, 0.0) <= time.monotonic() and body_len < self.nc.max_payload - 4096

    def endpoint_absent(self, key: tuple[str, int]) -> None:
        if self._off.get(key, 0.0) <= time.monotonic():
            logger.info("replica_endpoint_absent", model_key=key[0], replica_id=key[1], retry_s=RETRY_S)
        self._off[key] = time.monotonic() + RETRY_S

    def call(self, key: tuple[str, int], subject: str, actor: Any, body: bytes) -> asyncio.Future[list[Any]]:
        self._n += 1
        token = str(self._n)
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._calls[token] = _Call(key, actor, self._prefix + token, fut)
        fut.add_done_callback(lambda _f: self._calls.pop(token, None))
        self._send(subject, body, self._prefix + token)
        return fut

    async def _on_reply(self, msg: Msg) -> None:
        c = self._calls.get(msg.subject[len(self._prefix):])
        if c is None or c.fut.done():
            return
        if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS:
            c.fut.set_exception(NoEndpoint(f"no endpoint for replica {c.key[1]} of {c.key[0]}"))
            return
        try:
            kind, answers = _dec.decode(msg.data)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            c.fut.set_exception(ReplyLost(f"unreadable answer from replica {c.key[1]}: {exc}"))
            return
        if kind == PARKED:
            t = asyncio.ensure_future(self._take(c))
            self._taking.add(t)
            t.add_done_callback(self._taking.discard)
        else:
            c.fut.set_result(answers)

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


def encode_call(payloads: list[Any]) -> bytes:
    return _enc.encode(payloads)
