"""Reads and the live feed of the event stream: `read`, `follow` (and their batch forms), `read_subject`, `seq_at`.

Events come by an ordered push consumer, or by batched direct gets for users who may create no
consumer; followers check that sequences are contiguous and resubscribe from the last applied one
on a gap. Functions of a `FeedSource` (the log, log.py), whose settings are read at each use.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, Protocol

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from controlplane.core.ports import Stored
from controlplane.store.direct import MAX_BATCH, DirectMsg, direct_batch
from controlplane.store.eventstore.connection import stream_seq
from controlplane.store.eventstore.topology import last_seq
from schemas.errors import InfrastructureError, InfrastructureTimeout, LogRewound
from schemas.events import stored_item
from schemas.guard import decode_any
from schemas.subjects import EVENTS_ALL, EVENTS_STREAM

logger = structlog.get_logger("ndif.eventstore")

SHORT_READ = 10 * MAX_BATCH  # events: a read of fewer (with a known end) is made of batched direct gets


class FeedSource(Protocol):
    """The connection and the settings a feed reads, each time it needs one (JetStreamEventLog has them)."""

    nc: NatsClient
    js: JetStreamContext
    api: str  # the JetStream API prefix the connection's user reaches the streams under
    timeout: float
    pending_msgs_limit: int  # a consumer's client-side buffer, in messages
    pending_bytes_limit: int  # and in bytes
    stall_check_s: float  # a follower idle this long checks the stream for a stall
    direct_reads: bool  # batched direct gets instead of an ordered consumer
    direct_poll_s: float  # a direct-read follower asks again this often without a wake-up


async def read(src: FeedSource, start_seq: int = 1, *, start_time: datetime | None = None,
               stop_seq: int | None = None) -> AsyncIterator[Stored]:
    async for batch in read_batches(src, start_seq, start_time=start_time, stop_seq=stop_seq):
        for pair in batch:
            yield pair


async def read_batches(src: FeedSource, start_seq: int = 1, *, start_time: datetime | None = None,
                       stop_seq: int | None = None) -> AsyncIterator[list[Stored]]:
    """Like `read`, in lists of whatever arrived together (a fold then loops without awaiting)."""
    stop = await last_seq(src.js, src.timeout) if stop_seq is None else stop_seq
    if start_time is not None:
        found = await seq_at(src, start_time)
        if found is None:
            return
        start_seq = max(start_seq, found)
    if stop < max(start_seq, 1):
        return
    # A short stretch (a snapshot's check, the tail after it) by direct gets: no consumer to make.
    feed = _feed_direct if stop - max(start_seq, 1) < SHORT_READ else _feed
    async for batch in feed(src, start_seq, stop):
        yield batch


async def read_subject(src: FeedSource, subject: str, start_seq: int = 1, *,
                       stop_seq: int | None = None) -> AsyncIterator[Stored]:
    """The events on subjects matching `subject`, by batched direct gets that name it (`next_by_subj`):
    the server skips the rest, so a read of one model's events costs its events, not the log's."""
    stop = await last_seq(src.js, src.timeout) if stop_seq is None else stop_seq
    seq = max(start_seq, 1)
    while seq <= stop:
        msgs = await direct_batch(src.nc, EVENTS_STREAM, seq, MAX_BATCH, next_by_subj=subject, timeout=src.timeout,
                                  api=src.api)
        for m in msgs:
            if m.seq > stop:
                return
            yield m.seq, stored_item(m.subject, m.data)
        if not msgs:
            return
        seq = msgs[-1].seq + 1


async def follow(src: FeedSource, start_seq: int = 1) -> AsyncIterator[Stored]:
    async for batch in _feed(src, start_seq, None):
        for pair in batch:
            yield pair


def follow_batches(src: FeedSource, start_seq: int = 1) -> AsyncIterator[list[Stored]]:
    return _feed(src, start_seq, None)


async def seq_at(src: FeedSource, when: datetime) -> int | None:
    """Sequence of the first event stored at or after `when` (None if there is none)."""
    req = msgspec.json.encode({"start_time": when.isoformat().replace("+00:00", "Z")})
    try:
        resp = await src.nc.request(f"{src.api}.STREAM.MSG.GET.{EVENTS_STREAM}", req, timeout=src.timeout)
    except nats.errors.TimeoutError:
        raise InfrastructureTimeout("looking up a sequence by time timed out") from None
    body = decode_any(resp.data, limit=8 << 20, what="JetStream answer")  # the message, base64
    if not isinstance(body, dict) or not isinstance(body.get("error", {}), dict):
        raise InfrastructureError(f"looking up a sequence by time: an unreadable answer ({str(body)[:200]})")
    if "error" in body:
        if body["error"].get("code") == 404:
            return None
        raise InfrastructureError(f"looking up a sequence by time: {body['error'].get('description')}")
    seq = body.get("message", {}).get("seq") if isinstance(body.get("message"), dict) else None
    if not isinstance(seq, int):
        raise InfrastructureError("looking up a sequence by time: the answer names no sequence")
    return seq


async def _feed(src: FeedSource, start_seq: int, stop_seq: int | None) -> AsyncIterator[list[Stored]]:
    """Batches of events from `start_seq` to `stop_seq` (or forever): by direct gets or a consumer."""
    feed = _feed_direct if src.direct_reads else _feed_consumer
    async for batch in feed(src, start_seq, stop_seq):
        yield batch


async def _feed_direct(src: FeedSource, start_seq: int, stop_seq: int | None) -> AsyncIterator[list[Stored]]:
    """Batched direct gets (no consumer). Following, it asks again when an event is published on
    `ndif.evt.>` (a core subscription, only a wake-up) or after `direct_poll_s` without one."""
    expected = max(start_seq, 1)
    wake = asyncio.Event()
    woke = False
    sub = None
    if stop_seq is None:
        async def on_event(_: Msg) -> None:
            wake.set()

        with contextlib.suppress(Exception):  # without it (or refused by the server) polling alone
            sub = await src.nc.subscribe(EVENTS_ALL, cb=on_event)
    ahead: asyncio.Task[list[DirectMsg]] | None = None
    try:
        while stop_seq is None or expected <= stop_seq:
            want = MAX_BATCH if stop_seq is None else min(MAX_BATCH, stop_seq - expected + 1)
            wake.clear()
            msgs = await (ahead if ahead is not None else
                          direct_batch(src.nc, EVENTS_STREAM, expected, want, timeout=src.timeout, api=src.api))
            ahead = None
            if stop_seq is not None and msgs and msgs[-1].seq < stop_seq:
                # A read with an end asks for the next batch now, so the server reads and sends it
                # while this one is decoded and folded (at most two batches in flight).
                nxt = msgs[-1].seq + 1
                ahead = asyncio.create_task(direct_batch(src.nc, EVENTS_STREAM, nxt, min(MAX_BATCH, stop_seq - nxt + 1),
                                                         timeout=src.timeout, api=src.api))
            batch: list[Stored] = []
            for m in msgs:
                if stop_seq is not None and m.seq > stop_seq:
                    break
                batch.append((m.seq, stored_item(m.subject, m.data)))
            if batch:
                expected = batch[-1][0] + 1
                yield batch
                continue
            if stop_seq is not None:
                return  # nothing left up to stop_seq
            # Woken but nothing stored yet (the core message can come before the stream has
            # it): look again shortly rather than at the next poll.
            if not woke:  # a quiet poll: is the log still as long as what was read?
                await _check_not_rewound(src, expected)
            wait, woke = (0.02 if woke else src.direct_poll_s), False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
                woke = True
    finally:
        if ahead is not None:  # the reader stopped early: the batch asked ahead is not wanted
            ahead.cancel()  # (its own `finally` unsubscribes; its outcome is taken so none is left unread)
            ahead.add_done_callback(lambda t: t.cancelled() or t.exception())
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _check_not_rewound(src: FeedSource, expected: int) -> int:
    """The log's last sequence; LogRewound when it ends before `expected - 1`, what was read."""
    last = await last_seq(src.js, src.timeout)
    if last < expected - 1:
        raise LogRewound(f"the log ends at seq {last}, but this reader has read up to seq {expected - 1}: the "
                         "store lost its tail or was restored from a backup; fold the log again",
                         folded_seq=expected - 1, last_seq=last)
    return last


async def _feed_consumer(src: FeedSource, start_seq: int, stop_seq: int | None) -> AsyncIterator[list[Stored]]:
    """Ordered consumer over the whole stream, from `start_seq` to `stop_seq` (or forever).

    Sequences must be contiguous: on a gap (a client-side drop) or a stall the feed
    resubscribes from the next sequence it wants. Batches hold at most MAX_BATCH events. Messages are decoded in the delivery callback
    into a deque (nats-py's `next_msg()` costs a future per message and caps a drain near
    30k msg/s here; callbacks run about 3x faster).
    """
    expected = max(start_seq, 1)
    while True:
        buf: collections.deque[Stored | None] = collections.deque()
        ready = asyncio.Event()
        limit = src.pending_msgs_limit
        want = [expected]  # next seq the callback accepts; a mismatch ends this subscription

        async def on_msg(msg: Msg, buf: collections.deque[Stored | None] = buf, ready: asyncio.Event = ready,
                         want: list[int] = want, limit: int = limit) -> None:
            if not msg.reply or want[0] < 0:
                return  # a control message, or this subscription is being replaced
            seq = stream_seq(msg)
            if seq != want[0]:
                if seq < want[0]:
                    return  # replay after an ordered-consumer reset
                logger.warning("event_feed_gap", expected=want[0], got=seq)
                want[0] = -1
                buf.append(None)  # tells the reader to resubscribe
            elif len(buf) >= limit:  # past the limit drop it: the gap check recovers
                return
            else:
                want[0] = seq + 1
                buf.append((seq, stored_item(msg.subject, msg.data)))
            ready.set()

        sub = await _subscribe(src, expected, on_msg)
        try:
            while True:
                if not buf:
                    ready.clear()
                    try:
                        await asyncio.wait_for(ready.wait(), src.stall_check_s)
                    except TimeoutError:
                        # Quiet, or stalled: after a client-side drop the consumer's flow control
                        # can wait forever for a reply that never comes. Ask the stream which.
                        if src.nc.is_closed:
                            raise InfrastructureError("NATS connection closed while following events") from None
                        if await _check_not_rewound(src, expected) >= expected:
                            logger.warning("event_feed_stalled", expected=expected)
                            break  # resubscribe from `expected`
                    continue
                batch: list[Stored] = []
                gap = False
                while buf and len(batch) < MAX_BATCH:
                    item = buf.popleft()
                    if item is None:
                        gap = True
                        break
                    if stop_seq is not None and item[0] > stop_seq:
                        break
                    batch.append(item)
                if batch:
                    expected = batch[-1][0] + 1
                    yield batch
                if stop_seq is not None and expected > stop_seq:
                    return
                if gap:
                    break  # resubscribe from `expected`
                if buf:
                    # A backlog (a catch-up, a burst) is folded a batch at a time with the loop's
                    # other work in between: commands, heartbeats, a snapshot being stored.
                    await asyncio.sleep(0)
        finally:
            want[0] = -1
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _subscribe(src: FeedSource, start_seq: int, cb: Any) -> Any:
    # An ordered consumer: its flow control keeps the server from flooding us (a plain push
    # consumer measured slower here, ~45k vs ~75k events/s, the client drowning in its input).
    cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
    try:
        return await src.js.subscribe(
            EVENTS_ALL, stream=EVENTS_STREAM, ordered_consumer=True, config=cfg,
            deliver_policy=cfg.deliver_policy, cb=cb, pending_msgs_limit=src.pending_msgs_limit,
            pending_bytes_limit=src.pending_bytes_limit,
        )
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        # A server lost or a leader being elected (a cluster): the follower retries, never dies.
        raise InfrastructureTimeout(f"subscribing to {EVENTS_STREAM} from seq {start_seq} failed: "
                                    f"{type(exc).__name__}; retrying") from None
    except nats.js.errors.APIError as exc:
        raise InfrastructureError(f"subscribing to {EVENTS_STREAM} from seq {start_seq} failed: {exc}") from None

