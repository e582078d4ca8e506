"""Guarded appends to the event stream (docs/architecture.md §5, pitfalls §10).

- one event: an awaited request with `Nats-Expected-Last-Sequence` (never `publish_async`, which
  swallows error acks);
- several: one atomic batch (`Nats-Batch-Id/-Sequence/-Commit`), the expectation on message 1;
- an ambiguous answer (timeout, 10071 "wrong last sequence", 10201 "batch holds a duplicate id")
  is resolved by reading the log at expected+1 before anything is called a conflict;
- an observed fact (its subject carries its source: `is_fact_subject`) alone and unguarded: it is
  sent to the facts stream (`fact_inbox`), so its ack names a sequence of that stream, not of the
  log; the append returns once the fact gate has admitted it into the log, naming no log sequence
  (0..0), or raises `FactRefused` once the gate has refused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Sequence

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from controlplane.core.ports import AppendResult
from controlplane.store.eventstore.topology import last_seq
from schemas.errors import ConflictError, InfrastructureError, InfrastructureTimeout, InvalidCommand
from schemas.events import Event, check_batch, encode_event, event_headers, event_subject, event_tag, is_sourced_fact
from schemas.refusals import FactRefused, decode_refusal
from schemas.subjects import (
    EVENTS_STREAM,
    FACTS_STREAM,
    HDR_FACT_SEQ,
    HDR_MSG_ID,
    REFUSED_STREAM,
    fact_inbox,
    refused_subject,
)

logger = structlog.get_logger("ndif.eventstore")

ERR_WRONG_LAST_SEQ = 10071
ERR_BATCH_TOO_LARGE = 10199
ERR_BATCH_DUPLICATE = 10201
_LAST_SEQ_RE = re.compile(r"wrong last sequence: (\d+)")


class _ApiErr(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    count: int = 0
    error: _ApiErr | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


async def append(nc: NatsClient, js: JetStreamContext, events: Sequence[Event], expected_last_seq: int | None,
                 *, timeout: float, _resend: bool = False) -> AppendResult:
    """`EventLog.append` (controlplane/core/ports.py) on the event stream; requests wait up to `timeout`."""
    check_batch(events)
    n = len(events)
    if is_sourced_fact(events, expected_last_seq):
        return await _append_fact(nc, js, events[0], timeout=timeout)
    try:
        if n == 1:
            ack = await _publish_one(nc, events[0], expected_last_seq, timeout)
        else:
            ack = await _publish_batch(nc, events, expected_last_seq, timeout)
    except (TimeoutError, nats.errors.TimeoutError):
        if expected_last_seq is None:
            # Unguarded observed facts: a resend with the same ids is deduplicated by the server.
            if _resend:
                raise InfrastructureTimeout(
                    f"append of {n} observed events timed out twice; is JetStream up? (`ndif up`)") from None
            return await append(nc, js, events, None, timeout=timeout, _resend=True)
        # The request may or may not have been stored: find out before answering.
        found = await _read_back(js, events, expected_last_seq)
        if found is not None:
            return found
        raise InfrastructureTimeout(
            f"append of {n} events timed out and is not in the log after seq {expected_last_seq}; "
            "retry with the same event ids (a late landing is then reported as already appended)"
        ) from None
    except nats.errors.NoRespondersError:
        raise InfrastructureError(f"no stream answers on ndif.evt.>: create {EVENTS_STREAM} (`ndif up`)") from None
    if ack.error is None:
        if ack.duplicate and expected_last_seq is not None:  # a resend inside the duplicate window
            found = await _read_back(js, events, expected_last_seq)
            if found is not None:
                return found
            # Not where ours would be: the id is taken by a message at ack.seq. Ours only if it holds
            # our event; a user who can publish on any event subject can send any Nats-Msg-Id, so a
            # duplicate alone proves nothing.
            if await _holds(js, EVENTS_STREAM, ack.seq, events[-1]):
                return AppendResult(first_seq=ack.seq - n + 1, last_seq=ack.seq, already_appended=True)
            raise InfrastructureError(
                f"append of {n} events refused: the event id {events[-1].event_id!r} is taken in the log by "
                f"another message (seq {ack.seq}) and JetStream drops ours as its duplicate; nothing was "
                "appended: decide again under a new command id")
        return AppendResult(first_seq=ack.seq - n + 1, last_seq=ack.seq)
    err = ack.error
    if err.err_code in (ERR_WRONG_LAST_SEQ, ERR_BATCH_DUPLICATE) and expected_last_seq is not None:
        found = await _read_back(js, events, expected_last_seq)
        if found is not None:
            return found
        m = _LAST_SEQ_RE.search(err.description)
        actual = int(m.group(1)) if m else await last_seq(js, timeout)
        raise ConflictError(
            f"log moved: expected last seq {expected_last_seq}, it is {actual}; fold the tail and decide again",
            expected_last_seq=expected_last_seq, actual_last_seq=actual,
        )
    if err.err_code == ERR_BATCH_TOO_LARGE:
        raise InvalidCommand(f"append: batch refused as too large ({err.description})")
    raise InfrastructureError(f"append refused by JetStream: {err.code}/{err.err_code} {err.description}")


async def _append_fact(nc: NatsClient, js: JetStreamContext, ev: Event, *, timeout: float) -> AppendResult:
    """One observed fact into the facts stream; returns once the gate has admitted it into the log (an
    agent that announced itself is known to whoever reads the log next), with no log sequence: 0..0."""
    for attempt in (1, 2):
        try:
            ack = await _publish_one(nc, ev, None, timeout, subject=fact_inbox(event_subject(ev)))
            break
        except (TimeoutError, nats.errors.TimeoutError):
            # A resend with the same id is deduplicated by the facts stream.
            if attempt == 2:
                raise InfrastructureTimeout(
                    f"append of an observed fact to {FACTS_STREAM} timed out twice; is JetStream up? (`ndif up`)") from None
        except nats.errors.NoRespondersError:
            raise InfrastructureError(f"no stream answers on {fact_inbox(event_subject(ev))}: create {FACTS_STREAM} "
                                      "(`ndif up`)") from None
    if ack.error is not None:
        err = ack.error
        raise InfrastructureError(f"append refused by JetStream: {err.code}/{err.err_code} {err.description}")
    if ack.stream != FACTS_STREAM:
        raise InfrastructureError(f"{event_tag(ev)} was stored in {ack.stream or 'an unnamed stream'}, not "
                                  f"{FACTS_STREAM}: the streams predate the fact gate; run `ndif up` (its "
                                  "ensure migrates them)")
    # A duplicate is a resend of ours only if the message holding the id is ours byte for byte;
    # anyone who may publish facts can send any Nats-Msg-Id.
    if ack.duplicate and not await _holds(js, FACTS_STREAM, ack.seq, ev):
        raise InfrastructureError(
            f"append of {event_tag(ev)} refused: its event id {ev.event_id!r} is taken in {FACTS_STREAM} by another "
            f"message (seq {ack.seq}) and JetStream drops ours as its duplicate; nothing was appended")
    await _admitted(js, ev, ack.seq, timeout)
    return AppendResult(first_seq=0, last_seq=0, already_appended=ack.duplicate)


async def _admitted(js: JetStreamContext, ev: Event, facts_seq: int, timeout: float) -> None:
    """Wait until the gate has decided the fact at `facts_seq` of the facts stream: the log's last
    message on its subject came from there at that sequence or later (the gate keeps their order),
    or the gate's last refusal of its source names it (FactRefused)."""
    subject = event_subject(ev)
    refusal_subject = refused_subject(subject.rsplit(".", 1)[-1], facts_seq)
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline, pause = start + timeout, 0.0005
    while True:
        # The refusal first: the gate decides facts in order and keeps a refusal before it takes the
        # next fact, so a later fact of this subject in the log says nothing of this one until then.
        with contextlib.suppress(nats.js.errors.NotFoundError, nats.errors.TimeoutError, msgspec.DecodeError,
                                 nats.errors.NoRespondersError):
            raw = await js.get_msg(REFUSED_STREAM, subject=refusal_subject, direct=True)
            refusal = decode_refusal(raw.data or b"")
            raise FactRefused(f"{event_tag(ev)} refused by the fact gate: {refusal.reason}; it is not in the log")
        with contextlib.suppress(nats.js.errors.NotFoundError, nats.errors.TimeoutError):
            raw = await js.get_msg(EVENTS_STREAM, subject=subject, direct=True)  # the last on it
            seq = (raw.headers or {}).get(HDR_FACT_SEQ, "")
            if seq.isdigit() and int(seq) >= facts_seq:
                return
        if loop.time() > deadline:
            raise InfrastructureTimeout(
                f"{event_tag(ev)} is stored in {FACTS_STREAM} (seq {facts_seq}) but the fact gate has not admitted "
                f"it into {EVENTS_STREAM} within {timeout}s: is a controller running (`ndif up`, `ndif controller`)? "
                "A resend is deduplicated")
        await asyncio.sleep(pause)
        # Quick polls for a gate keeping up; slower ones once it is behind, where every waiting fact's
        # polls would take the servers' time from the gate itself (a backlog that feeds itself).
        pause = min(pause * 2, 0.05 if loop.time() - start < 1.0 else 0.5)


async def _publish_one(nc: NatsClient, ev: Event, expected: int | None, timeout: float, *,
                       subject: str | None = None) -> _PubAck:
    hdr = event_headers(ev)
    if expected is not None:
        hdr["Nats-Expected-Last-Sequence"] = str(expected)
    msg = await nc.request(subject or event_subject(ev), encode_event(ev), timeout=timeout, headers=hdr)
    return _ack_decoder.decode(msg.data)


async def _publish_batch(nc: NatsClient, events: Sequence[Event], expected: int | None, timeout: float) -> _PubAck:
    batch_id = uuid.uuid4().hex
    last = len(events)
    for i, ev in enumerate(events[:-1], start=1):
        hdr = event_headers(ev)
        hdr["Nats-Batch-Id"] = batch_id
        hdr["Nats-Batch-Sequence"] = str(i)
        if i == 1 and expected is not None:
            hdr["Nats-Expected-Last-Sequence"] = str(expected)
        await nc.publish(event_subject(ev), encode_event(ev), headers=hdr)
    ev = events[-1]
    hdr = event_headers(ev)
    hdr.update({"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(last), "Nats-Batch-Commit": "1"})
    msg = await nc.request(event_subject(ev), encode_event(ev), timeout=timeout, headers=hdr)
    return _ack_decoder.decode(msg.data)


async def _holds(js: JetStreamContext, stream: str, seq: int, ev: Event) -> bool:
    """Whether the message at `seq` of `stream` is `ev`, byte for byte."""
    try:
        raw = await js.get_msg(stream, seq, direct=True)
    except (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    return bool(raw.data == encode_event(ev) and raw.headers and raw.headers.get(HDR_MSG_ID) == ev.event_id)


async def _read_back(js: JetStreamContext, events: Sequence[Event], expected: int) -> AppendResult | None:
    """Are these event ids stored right after `expected`? (Then a resend or late success.)"""
    n = len(events)
    for offset, ev in ((0, events[0]), (n - 1, events[-1])):
        try:
            raw = await js.get_msg(EVENTS_STREAM, expected + 1 + offset, direct=True)
        except (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return None
        if not raw.headers or raw.headers.get(HDR_MSG_ID) != ev.event_id:
            return None
        if n == 1:
            break
    logger.info("append_already_stored", first_seq=expected + 1, events=n)
    return AppendResult(first_seq=expected + 1, last_seq=expected + n, already_appended=True)

