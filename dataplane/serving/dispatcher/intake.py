"""Intake: requests in, from the work-queue stream to each model's processor, and their time there.

Each model the log knows gets a processor and its durable consumers (`proc-<mtok>`, and
`part<k>-<mtok>` per user partition: decision 49); a subject of a
model the log does not know is triaged without one (its first valid request asks for a
deployment). Held requests are kept alive with in-progress acks, end in ERROR past the queue
lifetime, and can be killed by their user or an admin. The stream is the `RequestStream` port
(dataplane/serving/ports.py). Depends on the status writer and provisioning.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from controlplane.core.fairness import RequestQueue, TriagePlaces
from controlplane.core.projections import ClusterState
from controlplane.core.projections.queue import queue_view
from controlplane.store.credentials import msg_id_problem
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.dispatcher.provisioning import Provisioner
from dataplane.serving.dispatcher.statuses import StatusWriter
from dataplane.serving.ports import REQUEST_MAX_DELIVER, Delivery, RequestStream, StoredRequest
from dataplane.serving.processor import Pending, Processor
from schemas import errors as errs
from schemas.guard import decode_any
from schemas.keys import canonical_model_key, display_name
from schemas.requests import MAX_REQUEST_BYTES, Request, check_request_id, decode_request
from schemas.status import RequestStatus
from schemas.subjects import (
    REQUEST_PARTITIONS,
    consumed_request_subject,
    model_token,
    request_consumer,
    request_consumer_token,
    request_filters,
    request_partition,
    request_subject_parts,
    status_key,
    status_subject,
    valid_model_token,
)

logger = structlog.get_logger("ndif.dispatcher")
R = RequestStatus
# Unknown model names looked at at once (each reads the stream and may ask the controller for a
# deployment): a thousand new names at once made another user's status wait 2 s. One user holds at
# most TRIAGE_SHARE of the places; a name past them waits its turn in its user's line (the lines
# served in turn as triages end); past a line's TRIAGE_WAITING_SHARE or MAX_TRIAGE_WAITING in all,
# it is left to the sweep (`route_stored`, level-triggered), which routes every stored subject again.
MAX_TRIAGES = 16
TRIAGE_SHARE = 4
MAX_TRIAGE_WAITING = 10_000
TRIAGE_WAITING_SHARE = 625
TRIAGE_RETRIES = 3  # a triage whose reads fail is tried again this often (0.5, 1, 2 s later), then left to the sweep
FRESH_LOOKS = 5  # a name a publish woke, found empty, is read again 0.2, 0.4, ... 3.2 s apart (FRESH_WAIT_S in all)
FRESH_WAIT_S = 0.2 * (2 ** FRESH_LOOKS - 1)
TRIAGE_REREADS = 3  # a triage published on again while it reads reads again this often, then lines up again
UNKNOWN_CONSUMER_SWEEP_S = 10.0  # consumers of models the log does not know are deleted this often
KNOWN_GRACE_S = 10.0  # a processor made as its model was deployed waits this long for the fold to show it
# Queued requests a processor holds before it stops reading its heavier user partitions (the rest
# wait in the stream, for other dispatchers). A partition holding fewer than its share is still read
# then, so that two users at their queue limit do not stop a third user's requests from being read;
# what it holds is bounded all the same (MAX_HELD plus a share per partition).
MAX_HELD = 10_000
HELD_SHARE = MAX_HELD // REQUEST_PARTITIONS


@dataclass(kw_only=True, eq=False)
class Intake:
    state: ClusterState  # the dispatcher's fold (read only here)
    processors: dict[str, Processor]  # model token -> processor (shared with the log follower)
    requests: RequestStream
    statuses: StatusWriter
    provisioner: Provisioner
    bg: Background
    make_processor: Callable[[str], Processor]
    ack_wait_s: float  # held requests are kept alive every third of it
    queue_lifetime_s: float
    consumers: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # model token -> its consume task
    # Unknown model tokens being looked at (their user's) and waiting (whether a publish woke them: the
    # stream may not have stored it yet when their turn comes, as a core delivery can be seen first).
    triage: TriagePlaces = field(default_factory=lambda: TriagePlaces(
        places=MAX_TRIAGES, share=TRIAGE_SHARE, waiting_limit=MAX_TRIAGE_WAITING, waiting_share=TRIAGE_WAITING_SHARE))
    _triage_failures: dict[str, int] = field(default_factory=dict)  # token -> triages in a row that raised
    _triage_again: set[str] = field(default_factory=set)  # tokens (being triaged) published on again meanwhile
    _fresh_looks: dict[str, int] = field(default_factory=dict)  # token -> looks a woken name found empty
    _unknown_seen: set[str] = field(default_factory=set)  # consumer names found unknown at the last sweep
    _bad_seen: set[str] = field(default_factory=set)  # subject tokens that are no model's, said once (bounded)

    # ---- routing -----------------------------------------------------------------------------

    def processor(self, token: str) -> Processor | None:
        p = self.processors.get(token)
        if p is None and not self.bg.stopped:
            p = self.processors[token] = self.make_processor(token)
            self.consumers[token] = asyncio.create_task(self._consume(p), name=f"consume-{token}")
        return p

    def known_tokens(self) -> set[str]:
        return {model_token(mk) for mk in self.state.models}

    def route(self, token: str, *, fresh: bool = False, user: str = "") -> None:
        """Requests on `ndif.req.<token>`: a model the log knows gets its processor and durable consumer;
        any other subject is triaged without one (a consumer per junk subject would never go away),
        in `user`'s share of the triage's places. `fresh`: a publish on it just woke us (the stream
        may not have stored it yet)."""
        if token in self.processors or self.bg.stopped:
            return
        if not valid_model_token(token):
            # Never a filter: `ndif.req.*.alice` published literally would make `*` one, and the
            # triage would read (and, as on another model's subject, end) every model's requests.
            if len(self._bad_seen) < 1000 and token not in self._bad_seen:
                self._bad_seen.add(token)
                logger.warning("request_subject_ignored", token=token[:80],
                               why="not a model token: no consumer or triage reads it")
            return
        if token in self.known_tokens():
            self._triage_failures.pop(token, None)
            self._fresh_looks.pop(token, None)
            self.processor(token)
        elif token in self.triage.running:
            self._triage_again.add(token)  # published again meanwhile: its triage reads once more
        else:
            start = self.triage.ask(token, user, fresh)
            if start is not None:  # else its requests stay stored meanwhile, waiting their turn
                self.bg.spawn(self._triage(token, fresh=start))

    async def on_subject(self, subject: str) -> None:
        """A request was published on `subject`."""
        token, user = request_subject_parts(subject)
        if token:
            self.route(token, fresh=True, user=user)

    async def route_stored(self) -> None:
        """Route every model subject that holds stored requests (no stream yet: nothing to route);
        end those stored under a token that is no model's (nothing else would ever take them)."""
        for i, subject in enumerate(await self.requests.stored_subjects()):
            if i % 1000 == 999:
                await asyncio.sleep(0)  # thousands of stored names: the loop's other work goes on meanwhile
            token, user = request_subject_parts(subject)
            if token and not valid_model_token(token):
                await self._end_unroutable(subject)
            elif token:
                self.route(token, user=user)

    async def _end_unroutable(self, subject: str, limit: int = 1000) -> None:
        """End the requests stored on `subject` exactly, whose model token is no model's (`*` or `>`
        published literally). Read with the subject as a filter, where its wildcard matches others
        too: only exact matches are ended, at most `limit` a sweep."""
        seq, seen = 0, 0
        while seen < limit and not self.bg.stopped:
            raw = await self.requests.next_stored(subject, seq)
            if raw is None:
                return
            seq, seen = raw.seq, seen + 1
            if raw.subject == subject:
                _, user = request_subject_parts(raw.subject)
                await self._refuse_stored(raw.seq, raw.data or b"", raw.headers, "InvalidCommand",
                                          f"{subject[:200]!r} names no model (ndif.req.<model>.<user>)", user)

    # ---- triage of models the log does not know ----------------------------------------------

    async def _triage(self, token: str, *, fresh: bool = False) -> None:
        """Requests for a model the log does not know, read by subject (no consumer). The first valid
        one asks for a deployment: once the model is in the log, its processor takes over (with its
        durable consumer, from the stream's start). A request that is malformed, on another model's
        subject, or for a model the controller refuses ends ERROR and is deleted from the stream.

        A triage holds one of MAX_TRIAGES places only while it reads: woken by a publish (`fresh`)
        that the stream may not have stored yet, it looks again for FRESH_WAIT_S when it found nothing
        (a synced store acknowledges after its disk does, and a busy disk takes a while: past the
        first 0.6 s it gives its place up between looks and is routed again), and once
        more whenever the subject was published on again while it read; with no controller
        answering, it leaves the request stored (PROVISIONING said) for the sweep. A name that waited
        for its place keeps whether a publish woke it; a triage whose reads fail is tried again
        TRIAGE_RETRIES times before the sweep is left to find it. Published on again more than
        TRIAGE_REREADS times while it reads (by anyone: the place is its first user's), it gives its
        place up and lines up again, so no one's publishes hold a place of another's."""
        failed = requeue = False
        user = self.triage.running.get(token, "")
        try:
            waits, rereads = self._fresh_looks.pop(token, 0), 0
            while True:
                self._triage_again.discard(token)
                # userless subjects (an open server), each user partition's and every user subject,
                # a request of each in turn
                found = await self._triage_subjects(token, request_filters(token))
                if found is None:
                    return  # handed over (its processor), or left for the sweep
                if token in self._triage_again:
                    if rereads >= TRIAGE_REREADS:
                        requeue = True  # its place to the next in turn; it lines up again
                        return
                    fresh, waits, rereads = True, 0, rereads + 1  # published on again while we read: once more
                    continue
                if found or not fresh or waits >= FRESH_LOOKS:
                    return
                delay, waits = 0.2 * 2 ** waits, waits + 1
                if waits <= 2:
                    await asyncio.sleep(delay)  # the usual wait for a store: its place kept
                    continue
                # Longer: its place goes to the next in turn meanwhile, and it is routed again.
                if len(self._fresh_looks) < MAX_TRIAGE_WAITING:
                    self._fresh_looks[token] = waits
                    self.bg.spawn(self._route_later(token, user, delay))
                return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a read or delete failed (NATS slow or away)
            # Looked at again a few times, sooner than the sweep; then left to it.
            failed = True
            failures = self._triage_failures[token] = self._triage_failures.get(token, 0) + 1
            retry = failures <= TRIAGE_RETRIES
            logger.warning("triage_failed", token=token, error=str(exc) or type(exc).__name__, attempt=failures,
                           next="retried" if retry else "left to the sweep")
            if retry and len(self._triage_failures) <= MAX_TRIAGE_WAITING:
                self.bg.spawn(self._route_later(token, user, 0.5 * 2 ** (failures - 1)))
            else:
                self._triage_failures.pop(token, None)
        finally:
            if not failed:
                self._triage_failures.pop(token, None)
            self._triage_again.discard(token)
            for nxt, _, fresh_ in self.triage.done(token):  # its place goes to the next in turn
                self.bg.spawn(self._triage(nxt, fresh=fresh_))
            if requeue:
                self.route(token, fresh=True, user=user)

    async def _route_later(self, token: str, user: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.route(token, fresh=True, user=user)

    async def _triage_subjects(self, token: str, subjects: list[str]) -> int | None:
        """Read what is stored on `subjects` now, a request of each in turn (one user's pile of junk
        on a name is not read ahead of another user's first request on it); how many were read, or
        None when the triage ends here (the model has its processor now, or no controller answered).
        A request on two of the subjects is read once (the first deletes it, or the triage ends)."""
        cursors = dict.fromkeys(subjects, 0)
        read = 0
        while cursors and not self.bg.stopped:
            for subject in list(cursors):
                if token in self.processors or token in self.known_tokens():
                    self.processor(token)
                    return None
                raw = await self.requests.next_stored(subject, cursors[subject])
                if raw is None:
                    del cursors[subject]
                    continue
                cursors[subject], read = raw.seq, read + 1
                if not await self._triage_one(token, raw):
                    return None
        return None if self.bg.stopped else read

    async def _triage_one(self, token: str, raw: StoredRequest) -> bool:
        """One stored request of a name the log does not know: ended here (True: read on), or the
        triage ends (False: a deployment was asked for and made, or no controller answered)."""
        seq, data = raw.seq, raw.data or b""
        _, user = request_subject_parts(raw.subject)
        if not consumed_request_subject(raw.subject):  # read by nothing: it neither deploys nor stays
            await self._refuse_stored(seq, data, raw.headers, "InvalidCommand",
                                      f"{raw.subject[:200]!r} is not a request subject (ndif.req.<model>.<user>)")
            return True
        try:  # whatever the bytes: a request to deploy for, or one that ends here
            req, mk = _checked(data, user, token)
        except Exception as exc:  # noqa: BLE001 - InvalidCommand, or anything a check did not foresee
            await self._refuse_stored(seq, data, raw.headers, type(exc).__name__, str(exc), user)
            return True
        refused = self.provisioner.refusal(mk, user)
        if refused is not None:
            await self._refuse_stored(seq, data, raw.headers, *refused, user)
            return True
        # Tell the user while the controller decides (it may still refuse: then ERROR follows).
        self.statuses.status(Pending(msgspec.structs.replace(req, model_key=mk), None), R.PROVISIONING,
                             message=f"model {display_name(mk)} is not deployed: asking the controller "
                                     "to deploy it")
        try:
            refused = await self.provisioner.deploy_first(mk, user)
        except errs.NdifError as exc:
            # No controller: the request stays stored, and the sweep routes its subject again
            # (every UNKNOWN_CONSUMER_SWEEP_S); this triage's place goes to the next name.
            logger.warning("provision_failed", model_key=mk, error=str(exc))
            return False
        if refused is not None:
            await self._refuse_stored(seq, data, raw.headers, *refused, user)
            return True
        self.processor(token)  # deployed (by us or someone first): its consumer takes the requests
        return False

    async def _refuse_stored(self, seq: int, data: bytes, headers: dict[str, str] | None, error: str,
                             message: str, user: str = "") -> None:
        """End a stored request that will never run: ERROR under its id (if it has a valid one), then
        delete it from the work queue (nothing else would ever take it). Raises, deleting nothing,
        when the status could not be kept for a while (a bucket's server lost a moment); at a full
        store it is said live as StorageFull and deleted (statuses.py `_not_kept`)."""
        rid = _id_of(data, headers)
        logger.warning("request_refused", request_id=rid, error=error, message=message[:300])
        if rid and _valid_user(user):
            bogus = Request(request_id=rid, model_key="", payload={}, submitted_at=datetime.now(UTC), user=user)
            # Kept first: a write that fails (a server of the bucket's lost a moment) raises, and the
            # request stays stored for the triage's retry or the sweep, never deleted unsaid.
            await self.statuses.finish(Pending(bogus, None), R.ERROR, error=error, message=message)
        await self.requests.delete(seq)

    # ---- consumers ---------------------------------------------------------------------------

    async def remove_model(self, token_or_key: str, *, reason: str) -> bool:
        """Stop serving a model here: its waiting requests end ERROR (`reason`), its processor stops and
        its durable consumers (`proc-<mtok>`, `part<k>-<mtok>`) are deleted. The undeploy path calls this (with the model key
        or its token); the dispatcher itself does for a model the log no longer knows. Returns whether
        a consumer was deleted."""
        token = model_token(token_or_key) if "{" in token_or_key else token_or_key  # keys hold JSON, tokens never
        p = self.processors.pop(token, None)
        task = self.consumers.pop(token, None)
        if task is not None:
            task.cancel()
        if p is not None:
            p.fail_all("ModelRemoved", reason)
            tasks = p.tasks()
            for t in tasks:
                t.cancel()
            for running in p.in_flight.values():
                for held in running.values():
                    self.statuses.finish_soon(held, R.ERROR, error="ModelRemoved", message=reason)
        deleted = await self.requests.delete_consumer(token)
        logger.info("model_removed", token=token, reason=reason, consumer_deleted=deleted)
        return deleted

    async def sweep_consumers(self) -> list[str]:
        """Delete the durable consumers of models the log does not know, once seen unknown
        at two sweeps in a row (a model deployed a moment ago may not be in this fold yet)."""
        known = self.known_tokens()
        unknown = {request_consumer(t) for t in await self.requests.consumer_tokens() if t not in known}
        gone = sorted(unknown & self._unknown_seen)
        self._unknown_seen = unknown - set(gone)
        for name in gone:
            await self.remove_model(request_consumer_token(name) or name, reason="the model is not in the log")
        return gone

    async def sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep_consumers()
                # Level-triggered: any subject still holding requests gets its processor or a triage.
                await self.route_stored()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away: next time
                logger.warning("consumer_sweep_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(UNKNOWN_CONSUMER_SWEEP_S)

    async def _consume(self, p: Processor) -> None:
        """Take the model's requests as they are stored (its durable consumers, made on the way)."""

        async def on_delivery(m: Delivery, attempt: int) -> None:
            await self._accept(p, m, attempt)

        while True:
            try:
                if p.token not in self.known_tokens():
                    if time.monotonic() - p.born < KNOWN_GRACE_S:
                        await asyncio.sleep(0.1)  # deployed a moment ago: our fold has not seen it yet
                        continue
                    # Removed (undeployed): never make a consumer for a model the log does not know.
                    self.bg.spawn(self.remove_model(p.token, reason="the model is no longer deployed"))
                    return
                await self.requests.consume(p.token, on_delivery, hold=PartitionHold(p.queue))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away or consumer gone: make it again
                logger.warning("consumer_restarting", token=p.token, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _accept(self, p: Processor, m: Delivery, attempt: int) -> None:
        """One delivered request, in its own guard: whatever its bytes and however often it was
        delivered, it is queued, or it ends (ERROR with the reason, where a status key can be formed)
        and leaves the queue. Nothing stays to be redelivered forever or to hold up the model."""
        _, user = request_subject_parts(m.subject)
        try:
            await self._accept_one(p, m, user, attempt)
        except Exception as exc:  # a request this code did not foresee ends; the next is read
            logger.exception("request_unhandled", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            await self._end_delivered(m, user, type(exc).__name__, f"the dispatcher could not take this request: {exc}")

    async def _end_delivered(self, m: Delivery, user: str, error: str, message: str, *, last: bool = False) -> None:
        """End a delivered request that will not run: ERROR under its key when one can be formed (the
        kept status's write acks it), else terminated (nobody can be told; never redelivered). When
        the status cannot be kept (a bucket's server lost a moment), it is left unacked, so it is
        delivered again after the ack wait and ended then; on its `last` delivery it is terminated.
        At a full store it is said live as StorageFull and acked (statuses.py `_not_kept`)."""
        rid = _id_of(m.data, m.headers)
        logger.warning("request_refused", request_id=rid, error=error, message=message[:300])
        if rid and _valid_user(user):
            bogus = Request(request_id=rid, model_key="", payload={}, submitted_at=datetime.now(UTC), user=user)
            try:
                await self.statuses.finish(Pending(bogus, m), R.ERROR, error=error, message=message)
                return
            except Exception as werr:  # noqa: BLE001 - its status could not be kept
                if not last:
                    logger.warning("request_refusal_deferred", request_id=rid, error=str(werr) or type(werr).__name__,
                                   next="ended again when delivered again (after the ack wait)")
                    return
                logger.warning("request_refused_unrecorded", request_id=rid, error=str(werr) or type(werr).__name__)
        with contextlib.suppress(Exception):
            await m.term()

    async def _accept_one(self, p: Processor, m: Delivery, user: str, attempt: int) -> None:
        if attempt >= REQUEST_MAX_DELIVER:
            # The server delivers no more after this: end it now, before anything of it runs again
            # (each earlier delivery's dispatcher stopped without ending it, perhaps because of it).
            await self._end_delivered(m, user, "DeadLetter",
                                      f"delivered {attempt} times without ending (each time its dispatcher "
                                      "stopped first); it is not run again: submit it again", last=True)
            return
        try:
            req, mk = _checked(m.data, user, p.token)
            # Deduplication is stream-wide: an id that does not name its owner is not the SDK's
            problem = msg_id_problem((m.headers or {}).get("Nats-Msg-Id", ""), user=user, request_id=req.request_id)
            if problem is not None:
                raise errs.InvalidCommand(problem)
        except errs.NdifError as exc:
            await self._end_delivered(m, user, type(exc).__name__, str(exc))
            return
        if req.model_key != mk:
            req = msgspec.structs.replace(req, model_key=mk)
        # Only a redelivery can find its terminal status already kept (a first delivery that does,
        # a request id re-sent past the dedup window, runs again and its compare-and-set loses).
        done = await self.statuses.terminal(status_key(req.request_id, user)) if attempt > 1 else None
        if done is not None:
            # Finished by an earlier delivery whose dispatcher died before acking: never run twice.
            # It may also have died before publishing, so the kept terminal status is published again
            # (same bytes; clients stop at the first terminal status they see).
            await self.statuses.republish(status_subject(req.request_id, user), done)
            await m.ack()
            return
        if p.model_key is None:
            p.model_key = mk
            p.logger = p.logger.bind(model_key=mk)
            p.sync(queue_view(self.state, mk))
        p.enqueue(Pending(req, m, attempt=attempt))
        await self.statuses.flush()  # the replica call it started (if a lane was free) goes out now

    # ---- held requests: kept alive, expired, killed ------------------------------------------

    async def keepalive(self) -> None:
        """In-progress acks for every held request, well inside the ack wait."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for p in list(self.processors.values()):
                for held in p.held():
                    if held.msg is not None:
                        with contextlib.suppress(Exception):
                            await held.msg.in_progress()

    async def expire(self) -> None:
        """End requests that waited in a queue longer than their lifetime (clear error, acked)."""
        while True:
            await asyncio.sleep(min(2.0, self.queue_lifetime_s / 4))
            now = time.monotonic()
            for p in list(self.processors.values()):
                old = [w for w in p.queue if now - w.received >= self.queue_lifetime_s]
                for w in old:
                    p.queue.remove(w)
                    why = p.status if p.model_key is not None else "waiting"
                    self.statuses.finish_soon(w, R.ERROR, error="QueueTimeout",
                                              message=f"waited {now - w.received:.0f}s in the queue of {p.model_key} "
                                                      f"({str(why).lower()}), over the {self.queue_lifetime_s:g}s "
                                                      "limit (NDIF_REQUEST_QUEUE_LIFETIME_S); submit it again later")
                if old:
                    logger.warning("requests_expired", model_key=p.model_key, count=len(old))

    async def on_kill(self, msg: Msg) -> None:
        request_id = msg.data.decode(errors="replace").strip()
        parts = msg.subject.split(".")
        user = parts[3] if len(parts) > 3 else None  # None: an admin's kill (`ndif.dispatcher.kill`)
        for p in self.processors.values():
            pend = p.cancel(request_id, user)
            if pend is not None:
                await self.statuses.finish(pend, R.ERROR, error="Cancelled", message="cancelled by `ndif kill`")
                if msg.reply:
                    await msg.respond(b'{"ok": true}')
                return
        if msg.reply:
            await msg.respond(msgspec.json.encode({"ok": False, "message": f"{request_id} is not queued or running "
                                                                          "here (finished, or never submitted)"}))


def _checked(data: bytes, user: str, token: str) -> tuple[Request, str]:
    """A request body from the stream as the dispatcher takes it: the request (owned by the user of
    its subject) and its canonical model key, or InvalidCommand with the reason."""
    if not _valid_user(user):
        raise errs.InvalidCommand(f"request subject's user {user[:80]!r} is not a user name ([A-Za-z0-9_-])")
    req = decode_request(data)
    if req.user != user:
        req = msgspec.structs.replace(req, user=user)  # the owner is the subject's, never the body's
    mk, mtok = _model_of(req.model_key)
    if mtok != token:
        raise errs.InvalidCommand(f"request for {req.model_key[:200]!r} arrived on another model's subject")
    return req, mk


@functools.lru_cache(maxsize=256)
def _model_of(text: str) -> tuple[str, str]:
    """A request's model key made canonical (the SDK sends it absolute) and its subject token: the
    same few keys come with every request (a key that does not parse raises, and is not kept)."""
    mk = canonical_model_key(text, relative=False)
    return mk, model_token(mk)


def _valid_user(user: str) -> bool:
    """A subject's user token a status key can be formed with ("" on an open server)."""
    return not user or _valid_id(user) is not None


def _valid_id(rid: object) -> str | None:
    try:
        return check_request_id(rid)  # type: ignore[arg-type]
    except errs.InvalidCommand:
        return None


def _id_of(data: bytes, headers: dict[str, str] | None) -> str | None:
    """The request id of a body that may not decode: from the body, else from its `Nats-Msg-Id`
    (`[<user>.<mac>.]<request id>`); None when neither is one a status key can be formed with."""
    body = decode_any(data, limit=MAX_REQUEST_BYTES, what="request")
    rid = _valid_id(body.get("request_id")) if isinstance(body, dict) else None
    if rid is None:
        header = (headers or {}).get("Nats-Msg-Id", "")
        rid = _valid_id(header.rsplit(".", 1)[-1]) if isinstance(header, str) else None
    return rid


class PartitionHold:
    """`hold(k)` for a processor's consumers: stop reading the consumer of user partition k (None:
    the userless one) for now? Only when the processor holds MAX_HELD queued requests, and then
    only a partition holding its share (HELD_SHARE) or more of them: a light user's requests are
    still read behind two floods. The counts per partition are taken at most every `recount_s`
    (one pass over the users: cheap enough with 10,000 of them, not for every pull of 17 consumers)."""

    def __init__(self, queue: RequestQueue[Any], recount_s: float = 0.1) -> None:
        self.queue = queue
        self.recount_s = recount_s
        self._at = -float("inf")
        self._counts: dict[int | None, int] = {}

    def __call__(self, partition: int | None) -> bool:
        if len(self.queue) < MAX_HELD:
            return False
        now = time.monotonic()
        if now - self._at >= self.recount_s:
            self._counts = self.queue.queued_by(_user_partition)
            self._at = now
        return self._counts.get(partition, 0) >= HELD_SHARE


def _user_partition(user: str) -> int | None:
    """The partition whose consumer reads `user`'s requests (None: userless, the `proc-` consumer).
    A request stored before partitions (read by `proc-` too) counts under its user's partition."""
    return request_partition(user) if user else None
