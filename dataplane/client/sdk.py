"""The async client SDK for researchers: submit a request, stream its statuses, get the result.

    async with Client() as c:  # NDIF_NATS_URL, else nats://127.0.0.1:4222
        job = await c.submit("openai-community/gpt2", {"op": "generate", "prompt": "Hello", "max_new_tokens": 8})
        async for s in job.statuses():
            print(s.status, s.queue_position)
        result = await job.result()

A request is durable once `submit` returns (stored in the `NDIF_REQUESTS` stream; the same request
id re-submitted within the dedup window is stored once). Statuses arrive live on
`ndif.status.<user>.<id>` (`ndif.status.<id>` on an open server); a client that connects later (or reconnects) first reads the latest one kept in
KV, and a job that has been quiet for a while re-reads it, so a live status lost on the way (core
NATS is at-most-once) never leaves a user waiting for a terminal status that is already kept. A client with a user listens
to all of its user's statuses through one subscription (`ndif.status.<user>.>`, made as it connects)
and hands each to the jobs of its request id: no subscription is made and dropped per request, which
across the accounts of a secured server also adds and drops the server's copy of it in the system's
account. On an open server each job subscribes to its own subject (a wildcard there would bring
every user's statuses). `result()` raises `RequestFailed` for an ERROR
(`QueueLimitExceeded`, its subclass, when the user already had its limit of requests queued).

The SDK never writes to the user's stdout or stderr on its own: its logs go to the standard
`logging` loggers `ndif.*` (silent unless the program configures logging), and when the program
has not configured structlog, importing this module routes structlog there (`quiet_library_logs`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog

from controlplane.store.credentials import Creds, request_msg_id, resolve
from controlplane.store.direct import last_by_subject, read_object
from controlplane.store.eventstore import JetStreamEventLog
from schemas import errors as errs
from schemas.guard import Refused, decode_any
from schemas.keys import canonical_model_key
from schemas.requests import (
    MAX_REQUEST_BYTES,
    Request,
    StatusUpdate,
    check_request_id,
    encode_request,
    payload_problem,
    status_or_none,
)
from schemas.status import RequestStatus
from schemas.subjects import (
    REQUEST_STATUS_BUCKET,
    kill_subject,
    request_subject,
    results_bucket,
    status_key,
    status_subject,
    user_statuses,
)

DEFAULT_URL = "nats://127.0.0.1:4222"


def quiet_library_logs() -> None:
    """Library logging: `ndif.*` records go to stdlib logging (a NullHandler, so silent by default).

    structlog is configured only when the program has not configured it itself (its default
    writes to stdout); `ndif` commands and services configure their own (stderr) logging.
    """
    logging.getLogger("ndif").addHandler(logging.NullHandler())
    if not structlog.is_configured():
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                        structlog.processors.KeyValueRenderer(key_order=["event"])],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=False,
        )


quiet_library_logs()
logger = structlog.get_logger("ndif.client")

# While a job is quiet its kept status is re-read from KV, first after 2 s, backing off to 30 s.
KV_POLL_FIRST_S = 2.0
KV_POLL_MAX_S = 30.0


class RequestFailed(errs.NdifError):
    """The request ended in ERROR; `error` is the error class, `status` the terminal update."""

    def __init__(self, message: str, *, error: str | None = None, status: StatusUpdate | None = None) -> None:
        super().__init__(message)
        self._set(error=error, status=status)

    @property
    def error(self) -> str | None:
        return self._error  # type: ignore[attr-defined,no-any-return]

    @property
    def status(self) -> StatusUpdate | None:
        return self._status  # type: ignore[attr-defined,no-any-return]


class QueueLimitExceeded(RequestFailed):
    """Refused at once: the user already had `count` requests queued for the model, its limit is
    `limit` (the operator's NDIF_FAIRNESS). Nothing ran; submit again once some have finished."""

    @property
    def limit(self) -> int | None:
        return self.status.limit if self.status is not None else None

    @property
    def count(self) -> int | None:
        return self.status.count if self.status is not None else None


class ClientNotConnected(RuntimeError):
    """A `Client` used before `async with Client(...) as c:` connected it (or after it closed)."""


NOT_CONNECTED = ("this Client is not connected: use it as `async with Client(...) as c:` "
                 "(the connection is made on entering and closed on leaving)")


class Job:
    """One submitted request."""

    def __init__(self, client: Client, request_id: str, model_key: str) -> None:
        self.client = client
        self.request_id = request_id
        self.model_key = model_key
        self.last: StatusUpdate | None = None
        self._arrived: collections.deque[StatusUpdate] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sub: Any = None  # its own subscription (an open server), else None
        self._shared = False  # listening through the client's subscription to its user's statuses
        self._live_from_start = False  # submitted by us, listened to before it was sent: nothing to catch up

    def _accept(self, data: bytes, where: str) -> StatusUpdate | None:
        """A status of this job, or None: unreadable, or about another request or another user.

        The server lets only the dispatcher write a user's statuses; this check is the SDK's own, so
        that whatever else reaches this job's subject or key is never taken for its outcome."""
        u = status_or_none(data)
        if u is None:
            logger.warning("status_unreadable", request_id=self.request_id, where=where, size=len(data))
            return None
        if u.request_id != self.request_id or u.user != self.client.user:
            logger.warning("status_not_ours", request_id=self.request_id, where=where,
                           got_request_id=u.request_id[:128], got_user=u.user[:64])
            return None
        return u

    def _deliver(self, data: bytes) -> None:
        u = self._accept(data, "live")
        if u is not None:
            self._arrived.append(u)
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    @property
    def _listening(self) -> bool:
        return self._shared or self._sub is not None

    async def _listen(self, *, flush: bool = True) -> None:
        # Live statuses, and the kept ones as the server republishes them when KV stores them (the
        # terminal status only that way: it reaches us the moment it is kept, and only if it was).
        if self.client._watch(self):
            self._shared = True  # its subscription went out when the client connected: ahead of anything sent now
            return

        async def cb(msg: Any) -> None:
            self._deliver(msg.data)

        self._sub = await self.client.log.nc.subscribe(status_subject(self.request_id, self.client.user), cb=cb)
        if not flush:
            return  # the request is published next on this connection: the server sees the SUB first
        await self.client.log.nc.flush()

    async def latest(self) -> StatusUpdate | None:
        """The latest status kept in KV (what a reconnecting client starts from), by a direct get of
        this job's own key (the only read of the status bucket a client may make)."""
        key = status_key(self.request_id, self.client.user)
        got = await last_by_subject(self.client.log.nc, f"KV_{REQUEST_STATUS_BUCKET}",
                                    f"$KV.{REQUEST_STATUS_BUCKET}.{key}", timeout=self.client.timeout,
                                    api=self.client.log.api)
        if got is None or not got.data or got.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return self._accept(got.data, "kept")

    async def statuses(self, timeout: float | None = None) -> AsyncIterator[StatusUpdate]:
        """Every status from now to the terminal one (starting from the latest kept, if newer). On a
        job that has ended, its terminal status, at once."""
        if self.last is not None and self.last.terminal:
            yield self.last  # nothing more will come: the job is over
            return
        if not self._listening:
            await self._listen()
        kept = None if self._live_from_start else await self.latest()
        if kept is not None and (self.last is None or kept.ts > self.last.ts):
            self.last = kept
            yield kept
            if kept.terminal:
                return
        quiet_since = time.monotonic()
        poll = KV_POLL_FIRST_S
        while True:
            wait = poll if timeout is None else max(0.0, min(poll, quiet_since + timeout - time.monotonic()))
            try:
                u = await self._next(wait)
            except TimeoutError:
                # Quiet for a while: a live status may have been missed (a reconnect, or a dispatcher
                # that died between keeping a status and publishing it). KV has the latest.
                kept = await self.latest()
                if kept is not None and (self.last is None or kept.ts > self.last.ts):
                    self.last, quiet_since, poll = kept, time.monotonic(), KV_POLL_FIRST_S
                    yield kept
                    if kept.terminal:
                        await self.close()
                        return
                    continue
                if timeout is not None and time.monotonic() - quiet_since >= timeout:
                    raise errs.InfrastructureTimeout(
                        f"no status for {self.request_id} within {timeout}s (last: "
                        f"{self.last.status if self.last else 'none'}); is a dispatcher running?") from None
                poll = min(poll * 2, KV_POLL_MAX_S)
                continue
            quiet_since, poll = time.monotonic(), KV_POLL_FIRST_S
            if self.last is not None and self.last.terminal:
                return
            if self.last is not None and (u.ts < self.last.ts or u == self.last):
                continue  # already seen (kept in KV and also received live)
            self.last = u
            yield u
            if u.terminal:
                await self.close()
                return

    async def _next(self, wait: float) -> StatusUpdate:
        """The next status that arrived (TimeoutError after `wait` seconds without one)."""
        if not self._arrived:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, wait)
            finally:
                self._waiter = None
        return self._arrived.popleft()

    async def result(self, timeout: float | None = 300.0) -> Any:
        """The result of a COMPLETED request; `RequestFailed` for ERROR."""
        final = self.last if self.last is not None and self.last.terminal else None
        if final is None:
            async for u in self.statuses(timeout=timeout):
                final = u
        assert final is not None
        if final.status is RequestStatus.ERROR:
            kind = QueueLimitExceeded if final.error == "QueueLimitExceeded" else RequestFailed
            raise kind(f"{final.error or 'error'}: {final.message}", error=final.error, status=final)
        if final.result_ref:
            # The dispatcher names a large result after its status key: any other name is not this job's.
            want = f"{status_key(self.request_id, self.client.user)}.json"
            if final.result_ref != want:
                raise RequestFailed(f"the result of {self.request_id} names object {final.result_ref[:200]!r}, "
                                    f"not {want!r}: not taken", error="ResultNotOurs", status=final)
            # This user's own bucket, by direct gets (controlplane/store/direct.py): a client may create no consumer.
            data = await read_object(self.client.log.nc, results_bucket(self.client.user), final.result_ref,
                                     timeout=self.client.timeout, api=self.client.log.api)
            out = decode_any(data, limit=len(data), what="result")
            if out.__class__ is Refused:
                raise errs.InfrastructureError(f"the result of {self.request_id} cannot be read: {out.reason}")
            return out
        return final.result

    async def close(self) -> None:
        if self._shared:
            self._shared = False
            self.client._unwatch(self)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


class Client:
    """`creds`: this user's credentials (auth.Creds); None finds them as every local command does
    (NDIF_CREDS, else the client file `ndif up` wrote under $NDIF_HOME/auth/, else none: an open
    server). With a user, requests, statuses and kills are that user's own (`ndif.req.*.<user>`,
    `ndif.status.<user>.>`): the server refuses anyone else's."""

    def __init__(self, url: str | None = None, *, name: str = "ndif-client", timeout: float = 10.0,
                 creds: Creds | None = None) -> None:
        """`url`: the NATS server; default `NDIF_NATS_URL`, else nats://127.0.0.1:4222."""
        self.url = url or os.environ.get("NDIF_NATS_URL") or DEFAULT_URL
        self.name = name
        self.timeout = timeout
        self.creds = creds if creds is not None else resolve("client", url=self.url)
        self.user = self.creds.name if self.creds is not None and self.creds.role == "client" else ""
        self._log: JetStreamEventLog | None = None
        self._status_sub: Any = None  # with a user: its subscription to all of the user's statuses
        self._watching: dict[str, list[Job]] = {}  # request id -> the jobs listening to its statuses

    @property
    def log(self) -> JetStreamEventLog:
        """The connection; `ClientNotConnected` outside `async with Client(...)`."""
        if self._log is None:
            raise ClientNotConnected(NOT_CONNECTED)
        return self._log

    async def __aenter__(self) -> Client:
        self._log = await JetStreamEventLog.open(self.url, ensure=False, name=self.name, timeout=self.timeout,
                                                 creds=self.creds, role="client")
        if self.user:
            try:
                self._status_sub = await self._log.nc.subscribe(user_statuses(self.user), cb=self._on_status)
                await self._log.nc.flush()
            except BaseException:
                log, self._log = self._log, None
                await log.close()
                raise
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        log, self._log = self._log, None
        self._status_sub = None  # goes with the connection
        for jobs in self._watching.values():
            for job in jobs:
                job._shared = False
        self._watching.clear()
        if log is not None:
            await log.close()

    def _watch(self, job: Job) -> bool:
        """Hand `job` its request's statuses from the user's subscription; False without one (an open server)."""
        if self._status_sub is None:
            return False
        self._watching.setdefault(job.request_id, []).append(job)
        return True

    def _unwatch(self, job: Job) -> None:
        jobs = self._watching.get(job.request_id, [])
        if job in jobs:
            jobs.remove(job)
        if not jobs:
            self._watching.pop(job.request_id, None)

    async def _on_status(self, msg: Any) -> None:
        # `ndif.status.<user>.<request id>`: the id is the last token (ids are one token each)
        for job in self._watching.get(msg.subject.rpartition(".")[2], ()):
            job._deliver(msg.data)

    async def submit(self, model: str, payload: dict[str, Any], *, request_id: str | None = None) -> Job:
        """Store the request durably and return its job (statuses are listened to before it is sent).

        A payload the replica would refuse whatever model runs it (schemas/requests.py
        `payload_problem`) raises InvalidCommand here, before anything is stored."""
        problem = payload_problem(payload)
        if problem is not None:
            raise errs.InvalidCommand(f"invalid request: {problem}")
        mk = canonical_model_key(model)
        rid = check_request_id(request_id or uuid.uuid4().hex)
        try:
            body = encode_request(Request(request_id=rid, model_key=mk, payload=payload,
                                         submitted_at=datetime.now(UTC), client=self.name))
        except (RecursionError, TypeError, msgspec.EncodeError) as exc:  # too deep, or not JSON at all
            raise errs.InvalidCommand(f"invalid request: the payload cannot be sent as JSON "
                                      f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if len(body) > MAX_REQUEST_BYTES:
            raise errs.InvalidCommand(f"request of {len(body)} bytes is over the {MAX_REQUEST_BYTES} byte limit")
        self.log  # noqa: B018  # ClientNotConnected (after the request's own checks) before anything is listened to
        job = Job(self, rid, mk)
        await job._listen(flush=False)
        job._live_from_start = True
        try:
            await self.log.js.publish(request_subject(mk, self.user), body,
                                      headers={"Nats-Msg-Id": request_msg_id(rid, self.creds)}, timeout=self.timeout)
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):  # nats-py raises the latter
            await job.close()
            raise errs.InfrastructureError("no stream took the request (no NDIF_REQUESTS stream, or none reachable "
                                           "now): start the service (`ndif up`), or submit again") from None
        except nats.errors.TimeoutError:
            await job.close()
            raise errs.InfrastructureTimeout(
                f"submit of {rid} timed out; re-submit with request_id={rid!r} (it is stored at most once)") from None
        return job

    async def kill(self, request_id: str) -> dict[str, Any]:
        """Cancel one of this user's queued or running requests: `{"ok": bool, "message": ...}`."""
        subject = kill_subject(self.user)
        try:
            msg = await self.log.nc.request(subject, check_request_id(request_id).encode(), timeout=self.timeout)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise errs.InfrastructureError("no dispatcher answered the kill (is one running?)") from None
        out = decode_any(msg.data, limit=64 * 1024, what="kill answer")
        if not isinstance(out, dict):
            raise errs.InfrastructureError(f"the kill's answer cannot be read: {getattr(out, 'reason', out)!r}")
        return out

    async def job(self, request_id: str, model: str = "") -> Job:
        """A handle on an earlier request (e.g. after a reconnect): its statuses resume from KV."""
        return Job(self, check_request_id(request_id), canonical_model_key(model) if model else "")

    async def run(self, model: str, payload: dict[str, Any], *, timeout: float | None = 300.0) -> Any:
        """Submit and wait for the result."""
        job = await self.submit(model, payload)
        return await job.result(timeout=timeout)
