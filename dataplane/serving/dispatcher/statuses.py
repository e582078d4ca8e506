"""Statuses out: request statuses published and kept in KV, terminal ones exactly once, results stored.

A non-terminal status is published at once and reaches KV within STATUS_KV_DELAY_S (a newer one
supersedes it), except a QUEUED one: it is kept only once its request has waited QUEUED_KV_AFTER_S,
and then at most QUEUED_KV_PER_S a second (a flood's queued statuses would otherwise cost one
stored write each as the flood is taken in, and every request behind it in the stream, another
user's too, would wait for them). The terminal status is kept by compare-and-set on the key's revision, so a
redelivered request can never overwrite it, then the request is acked. Large results go to the
results store. Publishes go out in order from one outbox (drained by its task, or at once by the task
that delivered a request: `flush`). It works through the
serving ports (dataplane/serving/ports.py); of the dispatcher's other parts it uses only
`background` (the tasks it starts).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog

from dataplane.serving.dispatcher.background import Background
from dataplane.serving.ports import (
    Delivery,
    Publish,
    ResultStores,
    ResultsUnavailable,
    RevisionMoved,
    StatusKV,
    StorageFull,
)
from dataplane.serving.processor import Pending
from schemas.errors import InfrastructureError
from schemas.requests import INLINE_RESULT_BYTES, StatusUpdate, encode_status, status_or_none
from schemas.status import RequestStatus
from schemas.subjects import status_key, status_subject

logger = structlog.get_logger("ndif.dispatcher")
R = RequestStatus
KV_STATUSES = {R.RECEIVED, R.QUEUED, R.RUNNING, R.PROVISIONING, R.DEPLOYING}
STATUS_KV_DELAY_S = 0.25  # a non-terminal status reaches KV this late at most (it is published at once)
# A QUEUED status is kept once its request waited this long (a request served sooner never writes
# one: its RUNNING and terminal statuses supersede it), at most this many a second, oldest first.
QUEUED_KV_AFTER_S = 1.0
QUEUED_KV_PER_S = 250
_PACE_S = 0.05


class StatusWriter:
    """Writes every status of the dispatcher's requests (publish, KV, results store)."""

    def __init__(self, publish: Publish, kv: StatusKV, results: ResultStores, bg: Background) -> None:
        self.publish = publish
        self.kv = kv
        self.results = results
        self.bg = bg
        self._rev: dict[str, int] = {}  # request id -> KV revision of our last (non-terminal) status write
        self._writes: dict[str, _Writes] = {}  # request id -> its status writes
        self._outbox: collections.deque[tuple[str, bytes, str, dict[str, str] | None]] = collections.deque()
        self._outbox_task: asyncio.Task[None] | None = None
        self._draining = False  # the outbox is being published (by its task or by `flush`)
        self._lazy: dict[str, float] = {}  # key -> when its QUEUED status may be kept (oldest first)
        self._pacer: asyncio.Task[None] | None = None

    def cancel_timers(self) -> None:
        """Stopping: delayed KV writes of non-terminal statuses are not started."""
        for w in self._writes.values():
            if w.timer is not None:
                w.timer.cancel()
        self._lazy.clear()

    async def kept(self, key: str) -> tuple[StatusUpdate | None, int | None]:
        """The status kept in KV under `key` (`<user>.<request id>`) and its revision (None, None when
        there is none). A value that is not a status, or one of another request or user than its key
        names, was not written by a dispatcher: it is returned as no status (never terminal) with its
        revision, so the next compare-and-set replaces it."""
        got = await self.kv.get(key)
        if got is None:
            return None, None
        value, revision = got
        if not value:
            return None, revision
        cur = status_or_none(value)
        if cur is None or status_key(cur.request_id, cur.user) != key:
            logger.warning("kept_status_not_ours", key=key, readable=cur is not None, revision=revision)
            return None, revision
        return cur, revision

    async def terminal(self, key: str) -> StatusUpdate | None:
        """The terminal status kept under `key`, or None (none, not terminal, or not a status of that key)."""
        cur, _ = await self.kept(key)
        return cur if cur is not None and cur.terminal else None

    def _update(self, p: Pending, status: RequestStatus, **kw: Any) -> StatusUpdate:
        return StatusUpdate(request_id=p.req.request_id, status=status, ts=datetime.now(UTC),
                            model_key=p.req.model_key, attempt=p.attempt, user=p.req.user, **kw)

    def status(self, p: Pending, status: RequestStatus, **kw: Any) -> None:
        """A non-terminal status: published always, kept in KV for the ones a reconnecting client needs.

        It never holds up the caller: publishes go out in order from the outbox (`send`).
        """
        if self.bg.stopped:
            return
        u = self._update(p, status, **kw)
        data = encode_status(u)
        self.send(status_subject(u.request_id, u.user), data)
        if status in KV_STATUSES:
            self._kv_put(u, data, terminal=False).add_done_callback(_retrieve)

    def send(self, subject: str, data: bytes, reply: str = "", headers: dict[str, str] | None = None) -> None:
        """Publish without holding up the caller: in order, from the outbox (its task drains it a
        loop turn later, or the calling task sooner with `flush`)."""
        self._outbox.append((subject, data, reply, headers))
        self._start_outbox_task()

    def _start_outbox_task(self) -> None:
        if self._outbox_task is None:
            self._outbox_task = asyncio.create_task(self._flush_outbox())
            self.bg.track(self._outbox_task)

    async def flush(self) -> None:
        """Publish what waits in the outbox now, from the calling task: a request's replica call
        leaves a loop turn sooner than from the outbox task. Never raises but a cancellation (a
        publish that fails is logged and dropped, as the outbox task does). Order is kept: one drain
        at a time, and a drain under way takes what was added meanwhile."""
        if self._outbox and not self._draining:
            await self._drain()

    async def _flush_outbox(self) -> None:
        try:
            if not self._draining:
                await self._drain()
        finally:
            self._outbox_task = None
            if self._outbox and not self._draining:
                self._start_outbox_task()  # added after the drain ended (or left by one cancelled)

    async def _drain(self) -> None:
        """Publish the outbox in order, one message at a time: a drain cancelled (its task's
        subscription stopped) leaves the rest queued, and the outbox task takes them."""
        self._draining = True
        try:
            while self._outbox:
                subject, data, reply, headers = self._outbox.popleft()
                try:
                    # nats-py queues the message before it waits (for a full buffer): cancelled
                    # there, it is sent all the same, and is not put back.
                    await self.publish(subject, data, reply, headers)
                except Exception as exc:  # noqa: BLE001 - e.g. closed while stopping: this one is lost, not the rest
                    logger.warning("publish_failed", subject=subject[:200], error=str(exc) or type(exc).__name__)
        finally:
            self._draining = False
            if self._outbox:
                self._start_outbox_task()

    async def finish(self, p: Pending, status: RequestStatus, **kw: Any) -> bool:
        """The terminal status, written exactly once (CAS); then the request is acked.

        Kept by compare-and-set; the server republishes it on `ndif.status.[<user>.]<id>` as it is stored.
        """
        if status is R.COMPLETED and "result" in kw:
            body = msgspec.json.encode(kw["result"])
            if len(body) > INLINE_RESULT_BYTES:
                name = f"{status_key(p.req.request_id, p.req.user)}.json"
                try:
                    await self.results.put(p.req.user, name, body)
                except StorageFull as exc:
                    # Her store is at its limit: the request ends saying so (others' stores are their own).
                    logger.warning("results_store_full", request_id=p.req.request_id, user=p.req.user,
                                   limit_bytes=exc.limit_bytes)
                    status, kw = R.ERROR, {k: v for k, v in kw.items() if k != "result"}
                    kw.update(error="StorageFull", message=f"the result ({len(body)} bytes) was not stored: {exc}")
                except ResultsUnavailable as exc:
                    # No bucket for this user and no right to make one: say so, never drop it.
                    why = type(exc.__cause__ or exc).__name__
                    logger.error("results_bucket_unavailable", request_id=p.req.request_id, user=p.req.user,
                                 error=str(exc))
                    status, kw = R.ERROR, {k: v for k, v in kw.items() if k != "result"}
                    kw.update(error="ResultNotStored", message=f"the result ({len(body)} bytes) could not be "
                              f"stored: no results bucket for user {p.req.user!r} ({why})")
                else:
                    kw = {**kw, "result": None, "result_ref": name}
        u = self._update(p, status, **kw)
        try:
            wrote = await self._kv_put(u, encode_status(u), terminal=True)
        except StorageFull as exc:
            self._not_kept(p, u, exc)
            if p.msg is not None and p.msg.reply:
                self.send(p.msg.reply, b"")  # the ack, from the outbox after the status it follows
                return False
            wrote = False
        if p.msg is not None:
            with contextlib.suppress(Exception):
                await p.msg.ack()
        return wrote

    def _not_kept(self, p: Pending, u: StatusUpdate, exc: StorageFull) -> None:
        """The server's store refused the terminal status: the request ends ERROR StorageFull,
        published (not kept: nothing can be), and is acked, since running it again would end the
        same way and a retry count would end it with a false reason."""
        logger.error("status_store_full", request_id=u.request_id, user=u.user, outcome=u.status.value,
                     error=str(exc))
        outcome = u.status.value + (f" {u.error}: {u.message}" if u.error else "")
        honest = self._update(p, R.ERROR, error="StorageFull",
                              message=f"the request's outcome ({outcome[:2000]}) could not be kept: {exc}")
        self.send(status_subject(u.request_id, u.user), encode_status(honest))

    def finish_soon(self, p: Pending, status: RequestStatus, **kw: Any) -> None:
        """`finish` for a lane that goes on at once: the write starts now, the ack follows it from
        the outbox (no task of its own, unless the result is large and goes to the results store)."""
        if self.bg.stopped:
            return  # not acked: redelivered to the next dispatcher
        u = self._update(p, status, **kw)
        data = encode_status(u)
        if len(data) > INLINE_RESULT_BYTES and u.result is not None:
            self.bg.spawn(self.finish(p, status, **kw))
            return
        fut = self._kv_put(u, data, terminal=True)
        msg = p.msg
        if msg is not None and msg.reply:
            fut.add_done_callback(lambda f: self._ack_after(f, msg, p, u))

    async def republish(self, subject: str, u: StatusUpdate) -> None:
        """Publish a kept status again on `subject`, as it is (a redelivered request's terminal status)."""
        await self.publish(subject, encode_status(u), "", None)

    def _ack_after(self, fut: asyncio.Future[bool], msg: Delivery, p: Pending, u: StatusUpdate) -> None:
        if fut.cancelled():
            return  # stopping: redelivered
        if isinstance(exc := fut.exception(), StorageFull):
            self._not_kept(p, u, exc)  # then acked, in order after it
        elif exc is not None:
            logger.warning("terminal_status_not_kept", error=str(exc))  # not acked: redelivered
            return
        self.send(msg.reply, b"")  # the ack (what Msg.ack() sends), in order after the statuses

    def _kv_put(self, u: StatusUpdate, data: bytes, *, terminal: bool) -> asyncio.Future[bool]:
        """Keep a status in KV: per request one write in flight, a newer status replaces a waiting one.

        KV keeps only the latest status, so a QUEUED still waiting when RUNNING comes is never sent
        (and two writes of one request never race each other's revision). A waiting terminal status
        is never replaced: whatever comes after it resolves False, as the compare-and-set would.
        """
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        key = status_key(u.request_id, u.user)
        w = self._writes.get(key)
        if w is None:
            w = self._writes[key] = _Writes()
        if w.waiting is not None:
            if w.waiting[2]:
                fut.set_result(False)
                return fut
            _resolve(w.waiting[3], True)  # superseded: the newer status is what KV will keep
        w.waiting = (u, data, terminal, fut)
        if w.task is None:
            if terminal:
                if w.timer is not None:
                    w.timer.cancel()
                self._lazy.pop(key, None)
                self._start_writes(key, w)
            elif u.status is R.QUEUED:
                if w.timer is None and key not in self._lazy:
                    self._lazy[key] = asyncio.get_running_loop().time() + QUEUED_KV_AFTER_S
                    if self._pacer is None:
                        self._pacer = asyncio.create_task(self._pace())
                        self.bg.track(self._pacer)
            elif w.timer is None:
                self._lazy.pop(key, None)
                # A status superseded within the delay is never written: a request that runs at
                # once costs one KV write (its terminal status), not three.
                w.timer = asyncio.get_running_loop().call_later(STATUS_KV_DELAY_S, self._start_writes, key, w)
        return fut

    async def _pace(self) -> None:
        """Start the KV writes of QUEUED statuses that waited long enough, at most QUEUED_KV_PER_S a second."""
        loop = asyncio.get_running_loop()
        try:
            while self._lazy:
                await asyncio.sleep(_PACE_S)
                now, budget = loop.time(), max(1, int(QUEUED_KV_PER_S * _PACE_S))
                while budget and self._lazy:
                    key, due = next(iter(self._lazy.items()))
                    if due > now:
                        break
                    del self._lazy[key]
                    w = self._writes.get(key)
                    if w is not None and w.waiting is not None:
                        self._start_writes(key, w)
                        budget -= 1
        finally:
            self._pacer = None

    def _start_writes(self, key: str, w: _Writes) -> None:
        w.timer = None
        if w.task is None and w.waiting is not None:
            w.task = asyncio.create_task(self._write_loop(key, w))
            self.bg.track(w.task)

    async def _write_loop(self, key: str, w: _Writes) -> None:
        try:
            while w.waiting is not None:
                u, data, terminal, fut = w.waiting
                w.waiting = None
                try:
                    _resolve(fut, await self._kv_write(u, data, terminal=terminal))
                except Exception as exc:  # noqa: BLE001 - handed to whoever awaits this write
                    if not fut.done():
                        fut.set_exception(exc)
        finally:
            if self._writes.get(key) is w:
                del self._writes[key]
            if w.waiting is not None:  # cancelled (stopping) with one waiting
                w.waiting[3].cancel()

    async def _kv_write(self, u: StatusUpdate, data: bytes, *, terminal: bool) -> bool:
        """Write unless a terminal status is already there (compare-and-set on the key's revision).

        The revision of our own last write is remembered, so the usual write is one round trip
        (create, or update expecting that revision); only a lost race reads the key first.
        """
        key = status_key(u.request_id, u.user)
        rev = self._rev.pop(key, None)
        for attempt in range(20):
            try:
                new_rev = await (self.kv.create(key, data) if rev is None else self.kv.update(key, data, rev))
            except RevisionMoved:
                cur, rev = await self.kept(key)
                if cur is not None and cur.terminal:
                    return False
                if rev is None or attempt:
                    # The read did not see the write that moved the key (no key, or the same old
                    # revision again): a direct get answered by a copy of a replicated bucket that
                    # has not stored it yet. Give it time to, rather than spend every try at once.
                    await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
                continue
            if not terminal:
                self._rev[key] = new_rev
            return True
        if terminal:
            # Not kept: the request must not be acked as if it were (it is delivered again).
            logger.error("terminal_status_not_written", request_id=key)
            raise InfrastructureError(f"the terminal status of {key} could not be kept after 20 tries "
                                      "(its key kept moving); the request is delivered again")
        return False


class _Writes:
    __slots__ = ("task", "timer", "waiting")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.waiting: tuple[StatusUpdate, bytes, bool, asyncio.Future[bool]] | None = None


def _retrieve(fut: asyncio.Future[bool]) -> None:
    """Nobody waits for a non-terminal status write: look at its outcome so a failure is logged once."""
    if not fut.cancelled() and fut.exception() is not None:
        logger.warning("status_not_kept", error=str(fut.exception()))


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
