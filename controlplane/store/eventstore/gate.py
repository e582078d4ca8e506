"""The fact gate: observed facts from NDIF_FACTS into the log, each checked before it is kept.

Agents and dispatchers send facts to the facts stream (`ndif.fact.…`), never to the log. The gate,
run by the controller, reads them in order through one durable consumer (one fact in flight, so
any number of controllers keep the log's order of facts) and, for each, either appends its
canonical form to the log on its fact subject (`Ndif-Fact-Seq` names where it came from; the
event id is the log's dedup id, so a fact redelivered after a crash is stored once), or keeps a
`FactRefusal` on `ndif.refused.<source>` (bounded, never the log) and logs why. What is admitted is
decided by controlplane/core/facts.py against the controller's fold.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from controlplane.core.facts import admit
from controlplane.core.projections.cluster import ClusterState
from schemas.errors import InfrastructureError
from schemas.events import AnyEvent, encode_event, event_headers, event_subject
from schemas.refusals import MAX_REASON_CHARS, FactRefusal, decode_refusal, encode_refusal
from schemas.subjects import (
    EVENTS_STREAM,
    FACT_GATE_CONSUMER,
    FACTS_STREAM,
    HDR_FACT_SEQ,
    REFUSED_STREAM,
    refused_subject,
)

logger = structlog.get_logger("ndif.factgate")

# How long an unknown replica's fact waits for the fold to reach the log's end before it is refused.
CATCH_UP_S = 5.0
# Deliveries of one fact the log did not answer before the gate refuses it (one fact holds the rest).
GATE_TRIES = 5


class _Ack(msgspec.Struct):
    seq: int = 0
    duplicate: bool = False
    error: dict[str, object] | None = None


_ack = msgspec.json.Decoder(_Ack)


class FactGate:
    """`run()` until cancelled. `state()`: the controller's fold; `caught_up()`: returns once the
    fold holds the log up to its end as of the call (or raises on its own timeout)."""

    def __init__(self, nc: NatsClient, js: JetStreamContext, state: Callable[[], ClusterState],
                 caught_up: Callable[[], Awaitable[None]], *, timeout: float = 5.0) -> None:
        self.nc, self.js = nc, js
        self.state, self.caught_up = state, caught_up
        self.timeout = timeout
        self.admitted = 0
        self.refused = 0

    async def run(self) -> None:
        while True:
            sub = None
            try:
                sub = await self.js.pull_subscribe_bind(durable=FACT_GATE_CONSUMER, stream=FACTS_STREAM)
                while True:
                    try:
                        msgs = await sub.fetch(1, timeout=5.0)
                    except (TimeoutError, nats.errors.TimeoutError):
                        continue
                    for msg in msgs:
                        await self._one(msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the server away, the consumer missing: try again
                logger.warning("fact_gate_retry", error=f"{type(exc).__name__}: {exc}",
                               hint=f"the consumer {FACT_GATE_CONSUMER} of {FACTS_STREAM} is made by `ndif up`")
                await asyncio.sleep(1.0)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def _one(self, msg: Msg) -> None:
        facts_seq = msg.metadata.sequence.stream
        verdict = admit(msg.subject, msg.data, self.state(), datetime.now(UTC))
        if verdict.unknown:
            try:
                await asyncio.wait_for(self.caught_up(), CATCH_UP_S)
            except (TimeoutError, nats.errors.TimeoutError, InfrastructureError):
                # The fold could not reach the log's end: undecided (given again soon), refused only
                # after GATE_TRIES, so that no fact holds every later one for ever.
                if msg.metadata.num_delivered < GATE_TRIES:
                    await msg.nak(delay=1.0)
                    return
            verdict = admit(msg.subject, msg.data, self.state(), datetime.now(UTC))
        problem = verdict.problem
        if verdict.event is not None:
            try:
                problem = await self._append(verdict.event, facts_seq)
            except (TimeoutError, nats.errors.Error) as exc:
                if msg.metadata.num_delivered < GATE_TRIES:
                    raise  # the server away for a moment: the fact is given again after the ack wait
                problem = f"not appended to the log after {GATE_TRIES} tries: {type(exc).__name__}: {exc}"
        if problem and not await self._refuse(msg, problem, facts_seq):
            return  # the refusal is not kept: undecided, the fact is given again after the ack wait
        # A plain ack: with one fact in flight the next is given only once the server has this ack,
        # and a lost ack gives this fact again, which the log's dedup keeps once.
        await msg.ack()

    async def _append(self, ev: AnyEvent, facts_seq: int) -> str:
        """Append the admitted fact; "" once the log holds it, else why the log will not (a refusal:
        given again, the same fact would be refused again, and would hold every later fact)."""
        hdr = event_headers(ev)
        hdr[HDR_FACT_SEQ] = str(facts_seq)
        reply = await self.nc.request(event_subject(ev), encode_event(ev), timeout=self.timeout, headers=hdr)
        ack = _ack.decode(reply.data)
        if ack.error is not None:
            return f"the log refused it: {ack.error}"
        if ack.duplicate:  # its event id is in the log already (within the dedup window)
            got = await self.js.get_msg(EVENTS_STREAM, ack.seq, direct=True)
            if (got.headers or {}).get(HDR_FACT_SEQ) != str(facts_seq):
                return f"its event id {ev.event_id!r} is in the log already (seq {ack.seq}): sent twice"
        self.admitted += 1
        return ""

    async def _refuse(self, msg: Msg, problem: str, facts_seq: int) -> bool:
        """Keep the refusal (True once kept); the fact never enters the log."""
        source = msg.subject.rsplit(".", 1)[-1]
        refusal = FactRefusal(facts_seq=facts_seq, subject=msg.subject[:MAX_REASON_CHARS], source=source,
                              reason=problem, size=len(msg.data), ts=datetime.now(UTC))
        logger.warning("fact_refused", source=source, subject=msg.subject, facts_seq=facts_seq, reason=problem)
        try:
            await self.js.publish(refused_subject(source, facts_seq), encode_refusal(refusal), timeout=self.timeout)
        except (nats.js.errors.Error, nats.errors.Error) as exc:
            logger.error("fact_refusal_not_kept", source=source, facts_seq=facts_seq, error=str(exc))
            return False
        self.refused += 1
        return True


class Refusals(msgspec.Struct, frozen=True):
    """What `ndif status` says of the gate's refusals: how many are kept, and the newest."""

    count: int = 0
    last: FactRefusal | None = None


async def refusals(js: JetStreamContext) -> Refusals:
    """The refusals kept (bounded: REFUSED_STREAM's limits), and the newest; none on a store made
    before the gate."""
    try:
        info = await js.stream_info(REFUSED_STREAM)
    except (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return Refusals()
    count, last = int(info.state.messages), None
    if count:
        with contextlib.suppress(nats.js.errors.NotFoundError, nats.errors.TimeoutError, msgspec.DecodeError):
            last = decode_refusal((await js.get_msg(REFUSED_STREAM, int(info.state.last_seq), direct=True)).data or b"")
    return Refusals(count=count, last=last)
