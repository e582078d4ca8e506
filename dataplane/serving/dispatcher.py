"""The dispatcher: durable requests in, one Processor per model, statuses out (docs/architecture.md §1, §4).

- It folds the event stream with the same reducer as every component and hands each processor its
  queue view on every event: the processor's replica set is the log's, with no second control
  plane to lag behind.
- Requests live in the work-queue stream `NDIF_REQUESTS` (`ndif.req.<mtok>.<user>`; `ndif.req.<mtok>`
  on an open server). Each model
  gets its own durable pull consumer (`proc-<mtok>`): a model waiting for provisioning holds its own
  requests only and never stalls another model's. A request is acked only at COMPLETED or ERROR;
  while held (queued or running) it is kept alive with in-progress acks. Execution is
  at-least-once (a dispatcher that dies loses its acks, so the requests are redelivered); the
  terminal status is written exactly once (KV compare-and-set), and a redelivered request that
  already has one is acked without running again.
- The first request for a model with no replicas sends `deploy` with NDIF_MODEL_REPLICAS_DEFAULT
  replicas; requests are served once NDIF_PROCESSOR_MIN_READY_REPLICAS are ready. If the last
  replica goes while requests wait, it provisions again and tells the waiting users.
- A draining replica takes no new request; once idle the dispatcher appends `ReplicaDrained`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import api

from controlplane.admin import AdminClient
from controlplane.auth import Creds
from controlplane.context import observed
from controlplane.eventstore import JetStreamEventLog
from controlplane.follow import follow_log
from controlplane.ports import Stored
from controlplane.projections import ClusterState
from controlplane.projections.queue import queue_view
from controlplane.tasks import cancel_and_wait
from dataplane.serving.processor import Pending, Processor
from dataplane.serving.provisioning import capacity_mark, never_fits
from dataplane.serving.pull import PullConsumer
from dataplane.serving.replica_link import ReplicaLink
from schemas import errors as errs
from schemas.events import ModelUndeployed, ReplicaDrained
from schemas.keys import canonical_model_key, display_name
from schemas.requests import (
    INLINE_RESULT_BYTES,
    Request,
    StatusUpdate,
    check_request_id,
    decode_request,
    encoder,
    status_decoder,
)
from schemas.status import RequestStatus
from schemas.subjects import (
    REQUEST_STATUS_BUCKET,
    REQUESTS_ALL,
    REQUESTS_STREAM,
    RESULTS_BUCKET,
    model_token,
    request_subject_parts,
    results_bucket,
    status_key,
    status_subject,
)

log = structlog.get_logger("ndif.dispatcher")
R = RequestStatus
_KV_STATUSES = {R.RECEIVED, R.QUEUED, R.RUNNING, R.PROVISIONING, R.DEPLOYING}
# A request held by a dispatcher that dies is redelivered this long after its last in-progress ack
# (sent every third of it while held): a dead dispatcher's requests move on within seconds.
ACK_WAIT_S = 4.0
UNKNOWN_CONSUMER_SWEEP_S = 10.0  # consumers of models the log does not know are deleted this often
KNOWN_GRACE_S = 10.0  # a processor made as its model was deployed waits this long for the fold to show it
REFUSED_MODEL_MEMO_S = 10.0  # a model the controller refused to deploy is not asked again for this long
MAX_REFUSED_MEMO = 1_000  # refused model names remembered at once (the names come from users: bounded)
TRIAGE_DEPLOYS = 4  # deployments the triage of unknown model subjects asks for at once
PROVISION_RETRY_S = 5.0  # a model the cluster has no room for is deployed again after 5 s, 10 s, ... 60 s
PROVISION_RETRY_MAX_S = 60.0
QUEUE_LIFETIME_S = 600.0  # a request still queued this long after a dispatcher took it ends in ERROR
MAX_HELD = 10_000  # queued requests a processor holds; the rest wait in the stream (for other dispatchers)
STATUS_KV_DELAY_S = 0.02  # a non-terminal status reaches KV this late at most (it is published at once)


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


class Dispatcher:
    def __init__(self, url: str, *, name: str | None = None, default_replicas: int | None = None,
                 min_ready: int | None = None, fetch_batch: int = 64, ack_wait_s: float | None = None,
                 replica_lanes: int | None = None, creds: Creds | None = None,
                 queue_lifetime_s: float | None = None) -> None:
        self.url = url
        self.creds = creds  # the dispatcher role's user (controlplane/auth.py); None: found locally
        self.name = name or f"dispatcher:{socket.gethostname()}"
        self.default_replicas = default_replicas or _env_int("NDIF_MODEL_REPLICAS_DEFAULT", 1)
        self.min_ready = min_ready or _env_int("NDIF_PROCESSOR_MIN_READY_REPLICAS", 1)
        self.fetch_batch = fetch_batch
        # Calls a replica is handed at once (like Ray Serve's max_ongoing_requests): the next call
        # is already at the replica when the current one ends, so the dispatch round trip never
        # leaves it idle. The replica still runs one request at a time, and its execution timeout
        # counts from the start of the run. Measured in tools/bench/dispatch.py with batching
        # (below): 1 lane ~980-1,170 req/s, 2 ~970-1,010, 4 ~800; 2 keeps a slow model's replica busy.
        self.replica_lanes = replica_lanes or _env_int("NDIF_REPLICA_LANES", 2)
        # Short requests waiting behind each other go to a replica in one call, as many as run in
        # NDIF_BATCH_BUDGET_MS by the model's recent run times (at most NDIF_BATCH_MAX): a replica call
        # costs more CPU than a no-op request itself (measured over the NATS link: NDIF_BATCH_MAX=1
        # 1,498 req/s, 8: 2,691, docs/benchmarks.md). Slow models go one by one.
        self.batch_max = _env_int("NDIF_BATCH_MAX", 8)
        self.batch_budget_s = float(os.environ.get("NDIF_BATCH_BUDGET_MS", 2.0)) / 1000
        # How long a request held by a dead dispatcher waits before redelivery (kept alive meanwhile).
        self.ack_wait_s = ack_wait_s or float(os.environ.get("NDIF_REQUEST_ACK_WAIT_S", ACK_WAIT_S))
        # How long a request may wait in a processor's queue (never placed, no room, no replica ready).
        try:
            self.queue_lifetime_s = queue_lifetime_s or float(os.environ.get("NDIF_REQUEST_QUEUE_LIFETIME_S",
                                                                             QUEUE_LIFETIME_S))
        except ValueError:
            raise errs.InvalidCommand("NDIF_REQUEST_QUEUE_LIFETIME_S takes seconds, e.g. 600") from None
        if not self.queue_lifetime_s > 0:
            raise errs.InvalidCommand(f"NDIF_REQUEST_QUEUE_LIFETIME_S must be > 0 (got {self.queue_lifetime_s})")
        # model token -> (capacity mark, reason it can never be placed or None) of its last rejected deploy
        self._rejected: dict[str, tuple[tuple[object, ...], str | None]] = {}
        self._rechecks: set[str] = set()  # model tokens with a provisioning timer set
        self.state = ClusterState()
        self.processors: dict[str, Processor] = {}  # model token -> processor
        self._consumers: dict[str, asyncio.Task[None]] = {}  # model token -> its consume task
        self.log_: JetStreamEventLog | None = None
        self.admin: AdminClient | None = None
        self.kv: Any = None
        self.results: Any = None  # the open server's shared bucket; users have their own (`_results_store`)
        self._user_results: dict[str, Any] = {}  # user -> its results bucket, opened or created
        self._tasks: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self._drained: set[tuple[str, int, int]] = set()
        self._rev: dict[str, int] = {}  # request id -> KV revision of our last (non-terminal) status write
        self._writes: dict[str, _Writes] = {}  # request id -> its status writes
        self._subs: list[Any] = []
        self._stopped = False
        self._outbox: list[tuple[str, bytes, str]] = []
        # Replica calls over NATS (dataplane/serving/replica_link.py); NDIF_REPLICA_LINK=ray makes them Ray calls.
        self.link: ReplicaLink | None = None
        link = os.environ.get("NDIF_REPLICA_LINK", "nats").strip().lower() or "nats"
        if link not in ("nats", "ray"):
            raise errs.InvalidCommand(f"NDIF_REPLICA_LINK is {link!r}: use 'nats' (the default) or 'ray'")
        self.use_link = link == "nats"
        self._outbox_task: asyncio.Task[None] | None = None
        self._triaging: set[str] = set()  # unknown model tokens whose requests are being looked at
        self._refused: dict[str, tuple[float, str, str]] = {}  # model key -> (until, error, message)
        self._unknown_seen: set[str] = set()  # consumer names found unknown at the last sweep
        # Deployments asked for by triage at once: a flood of unknown model names waits here instead
        # of queueing that many registry look-ups at the controller.
        self._triage_deploys = asyncio.Semaphore(TRIAGE_DEPLOYS)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Dispatcher:
        self.log_ = await JetStreamEventLog.open(self.url, name=self.name, creds=self.creds, role="dispatcher")
        self.admin = AdminClient(self.log_, actor=self.name)
        self.kv = await self.log_.js.key_value(REQUEST_STATUS_BUCKET)
        self.results = await self.log_.js.object_store(RESULTS_BUCKET)
        async for batch in self.log_.read_batches():
            for seq, item in batch:
                self.state.apply(seq, item)
        nc = self.log_.nc
        if self.use_link:
            self.link = await ReplicaLink(nc, self._send).start()
        # New model subjects are discovered from the publishes themselves; existing ones from the stream.
        self._subs.append(await nc.subscribe(REQUESTS_ALL, cb=self._on_publish))
        self._subs.append(await nc.subscribe("ndif.dispatcher.state", cb=self._on_state))
        self._subs.append(await nc.subscribe("ndif.dispatcher.kill", cb=self._on_kill))
        # A user's kill (`ndif.dispatcher.kill.<user>`, which only that user may publish): theirs only.
        self._subs.append(await nc.subscribe("ndif.dispatcher.kill.*", cb=self._on_kill))
        await self._route_stored()
        self._tasks += [asyncio.create_task(self._follow(), name="dispatcher-follow"),
                        asyncio.create_task(self._keepalive(), name="dispatcher-keepalive"),
                        asyncio.create_task(self._expire(), name="dispatcher-expire"),
                        asyncio.create_task(self._sweep_loop(), name="dispatcher-sweep")]
        log.info("dispatcher_started", name=self.name, seq=self.state.seq, processors=len(self.processors))
        return self

    async def stop(self) -> None:
        for w in self._writes.values():
            if w.timer is not None:
                w.timer.cancel()
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self._stopped = True
        tasks = [*self._tasks, *self._bg, *self._consumers.values()]
        for p in self.processors.values():
            tasks += [t for lanes in p.workers.values() for t in lanes]
        await cancel_and_wait(tasks, owner=self.name)
        if self.link is not None:
            await self.link.stop()
        if self.log_ is not None:
            await self.log_.close()

    async def __aenter__(self) -> Dispatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self._stopped:
            coro.close()  # stopping: nothing new starts (a request not finished is redelivered)
            return
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ---- the log -----------------------------------------------------------------------------

    async def _follow(self) -> None:
        assert self.log_ is not None
        await follow_log(self.log_, lambda: self.state.seq + 1, self._on_batch, logger=log,
                         fold=lambda: self.state)

    def _on_batch(self, batch: list[Stored]) -> None:
        undeployed: set[str] = set()
        for seq, item in batch:
            self.state.apply(seq, item)
            if isinstance(item, ModelUndeployed):
                undeployed.add(item.model_key)
        self._sync_all(undeployed)

    def _sync_all(self, undeployed: set[str] | frozenset[str] = frozenset()) -> None:
        known: set[str] | None = None
        for p in list(self.processors.values()):
            mk = p.model_key
            if mk is not None and mk in undeployed and p.queue:
                # `ndif undeploy` just now: the requests still waiting end (the ones running finish
                # as the replicas drain); nothing provisions the model again for them.
                p.fail_all("ModelUndeployed", f"{display_name(mk)} was undeployed (`ndif undeploy`) "
                                              "before this request ran; submit it again to deploy it anew")
            if mk is not None and mk in self.state.models:
                p.sync(queue_view(self.state, mk))
                continue
            known = known if known is not None else self._known_tokens()
            if p.token not in known and time.monotonic() - p.born > KNOWN_GRACE_S and not p.running():
                # undeployed and forgotten (or never known): its processor and durable consumer go
                self.spawn(self.remove_model(p.token, reason="the model is no longer deployed"))

    def report_drained(self, model_key: str, replica_id: int) -> None:
        r = self.state.replicas.get((model_key, replica_id))
        if r is None or str(r.state) != "Draining":
            return
        mark = (model_key, replica_id, r.since_seq)
        if mark in self._drained:
            return
        self._drained.add(mark)
        assert self.log_ is not None
        ev = observed(ReplicaDrained, actor=self.name, model_key=model_key, replica_id=replica_id, node_id=r.node_id)
        self.spawn(self.log_.append([ev], None))
        log.info("replica_drained", model_key=model_key, replica_id=replica_id)

    # ---- provisioning ------------------------------------------------------------------------

    def maybe_provision(self, p: Processor) -> None:
        """Requests wait and the model has no replica asked for: deploy it (once at a time).

        After a rejection the deploy is sent again only once the cluster's capacity changed (and
        not sooner than the backoff): an unchanged cluster would reject it again, and every deploy
        appends events. A model no node can ever hold fails its requests at once, until a node
        that changes that joins.
        """
        if p.model_key is None or not p.queue or p.provisioning:
            return
        if p.view is not None and p.view.replica_count > 0:
            return
        rejected = self._rejected.get(p.token)
        if rejected is not None:
            mark, never = rejected
            if mark == self._mark(p.model_key):
                if never is not None:
                    p.fail_all("PlacementImpossible", f"cannot place {p.model_key}: {never}")
                else:
                    self._recheck_later(p, PROVISION_RETRY_S)  # time alone can make room (evictions)
                return  # still no room: nothing appended
            wait = p.provision_not_before - time.monotonic()
            if never is None and wait > 0:
                self._recheck_later(p, wait)  # changed, but too soon after the last deploy
                return
        p.provisioning = True
        self.spawn(self._provision(p))

    def _retry_provision_later(self, p: Processor) -> None:
        """After a rejected deploy: the next one no sooner than the backoff (5 s, 10 s, ... 60 s)."""
        p.provision_backoff_s = min(max(p.provision_backoff_s * 2, PROVISION_RETRY_S), PROVISION_RETRY_MAX_S)
        p.provision_not_before = time.monotonic() + p.provision_backoff_s
        self._recheck_later(p, p.provision_backoff_s)

    def _recheck_later(self, p: Processor, delay_s: float) -> None:
        """Look at a waiting model again in `delay_s` (one timer per model at a time)."""
        if p.token in self._rechecks:
            return
        self._rechecks.add(p.token)

        def fire() -> None:
            self._rechecks.discard(p.token)
            if not self._stopped:
                self.maybe_provision(p)

        asyncio.get_running_loop().call_later(max(0.0, delay_s), fire)

    async def _provision(self, p: Processor) -> None:
        assert self.admin is not None and p.model_key is not None
        try:
            res = await self.admin.deploy(p.model_key, self.default_replicas)
            if res.rejections and not res.replicas:
                r = res.rejections[0]
                await self._folded(res.last_seq)
                never = never_fits(self.state, r.needed_bytes)
                self._rejected[p.token] = (self._mark(p.model_key), never)
                if never is not None:
                    # No node could hold it even empty: waiting cannot help, so the requests end now.
                    log.warning("provision_impossible", model_key=p.model_key, needed=r.needed_bytes, reason=never)
                    p.fail_all("PlacementImpossible", f"cannot place {p.model_key}: {never}")
                    return
                # No room anywhere now: tell the waiting users why and try again later (not in a loop).
                self._retry_provision_later(p)
                msg = (f"no room for {p.model_key}: needs {r.needed_bytes} bytes, {r.free_bytes} free; "
                       f"trying again in {p.provision_backoff_s:.0f}s (or scale/evict to make room)")
                log.warning("provision_rejected", model_key=p.model_key, needed=r.needed_bytes, free=r.free_bytes,
                            retry_s=p.provision_backoff_s)
                for w in list(p.queue):
                    self.status(w, R.PROVISIONING, message=msg)
                return
            p.provision_backoff_s = 0.0
            self._rejected.pop(p.token, None)
            log.info("provisioned", model_key=p.model_key, replicas=self.default_replicas)
        except errs.AlreadyDeployed:
            pass  # another dispatcher (or an operator) was first: fine
        except errs.InvalidCommand as exc:
            p.fail_all(type(exc).__name__, f"cannot deploy {p.model_key}: {exc}")
        except errs.NotFound as exc:
            p.fail_all(type(exc).__name__, str(exc))
        except errs.NdifError as exc:
            log.warning("provision_failed", model_key=p.model_key, error=str(exc))
            await asyncio.sleep(2.0)  # no controller yet: try again on the next event
        finally:
            p.provisioning = False
            await asyncio.sleep(0)
            if p.model_key in self.state.models:
                p.sync(queue_view(self.state, p.model_key))

    def _mark(self, model_key: str) -> tuple[object, ...]:
        """What a deploy's answer depends on: the cluster's capacity and the model's registered size."""
        m = self.state.models.get(model_key)
        size = m.registration.size_bytes if m is not None and m.registration is not None else None
        return capacity_mark(self.state, time.time()), size

    async def _folded(self, seq: int, timeout: float = 5.0) -> None:
        """Wait (bounded) until the fold has reached `seq`: marks are taken after our own events."""
        deadline = time.monotonic() + timeout
        while self.state.seq < seq and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _expire(self) -> None:
        """End requests that waited in a queue longer than their lifetime (clear error, acked)."""
        while True:
            await asyncio.sleep(min(2.0, self.queue_lifetime_s / 4))
            now = time.monotonic()
            for p in list(self.processors.values()):
                old = [w for w in p.queue if now - w.received >= self.queue_lifetime_s]
                for w in old:
                    p.queue.remove(w)
                    why = p.status if p.model_key is not None else "waiting"
                    self.finish_soon(w, R.ERROR, error="QueueTimeout",
                                     message=f"waited {now - w.received:.0f}s in the queue of {p.model_key} "
                                             f"({str(why).lower()}), over the {self.queue_lifetime_s:g}s "
                                             "limit (NDIF_REQUEST_QUEUE_LIFETIME_S); submit it again later")
                if old:
                    log.warning("requests_expired", model_key=p.model_key, count=len(old))

    # ---- requests in -------------------------------------------------------------------------

    def _processor(self, token: str) -> Processor | None:
        p = self.processors.get(token)
        if p is None and not self._stopped:
            p = self.processors[token] = Processor(token, self)
            self._consumers[token] = asyncio.create_task(self._consume(p), name=f"consume-{token}")
        return p

    def _known_tokens(self) -> set[str]:
        return {model_token(mk) for mk in self.state.models}

    def _route(self, token: str) -> None:
        """Requests on `ndif.req.<token>`: a model the log knows gets its processor and durable consumer;
        any other subject is triaged without one (a consumer per junk subject would never go away)."""
        if token in self.processors or self._stopped:
            return
        if token in self._known_tokens():
            self._processor(token)
        elif token not in self._triaging:
            self._triaging.add(token)
            self.spawn(self._triage(token))

    async def _on_publish(self, msg: Msg) -> None:
        token, _ = request_subject_parts(msg.subject)
        if token:
            self._route(token)

    async def _triage(self, token: str) -> None:
        """Requests for a model the log does not know, read by subject (no consumer). The first valid
        one asks for a deployment: once the model is in the log, its processor takes over (with its
        durable consumer, from the stream's start). A request that is malformed, on another model's
        subject, or for a model the controller refuses ends ERROR and is deleted from the stream."""
        try:
            # userless subjects (an open server), then every user's (`ndif.req.<mtok>.<user>`)
            for subject in (f"ndif.req.{token}", f"ndif.req.{token}.*"):
                await self._triage_subject(token, subject)
        finally:
            self._triaging.discard(token)

    async def _triage_subject(self, token: str, subject: str) -> None:
        assert self.log_ is not None and self.admin is not None
        js = self.log_.js
        seq = 0
        misses = 0
        while not self._stopped:
            if token in self.processors or token in self._known_tokens():
                self._processor(token)
                return
            try:
                raw = await js.get_msg(REQUESTS_STREAM, seq=seq + 1, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                # Nothing (more) on the subject. The publish that woke us may reach us before the
                # stream has stored it: look twice more; the sweep finds any later straggler.
                misses += 1
                if misses > 2:
                    return  # this subject: done
                await asyncio.sleep(0.2 * misses)
                continue
            misses = 0
            seq = int(raw.seq or seq + 1)
            data = raw.data or b""
            _, user = request_subject_parts(raw.subject or subject)
            try:
                req = decode_request(data)
                if req.user != user:
                    req = msgspec.structs.replace(req, user=user)  # the owner is the subject's
                mk = canonical_model_key(req.model_key, relative=False)  # the SDK sends it absolute
                if model_token(mk) != token:
                    raise errs.InvalidCommand(f"request for {req.model_key[:200]!r} arrived on another model's "
                                              "subject")
            except errs.NdifError as exc:
                await self._refuse_stored(seq, data, raw.headers, type(exc).__name__, str(exc), user)
                continue
            refused = self._refused.get(mk)
            if refused is not None and refused[0] > time.monotonic():
                await self._refuse_stored(seq, data, raw.headers, refused[1], refused[2], user)
                continue
            # Tell the user while the model is resolved and placed (its processor takes over after).
            self.status(Pending(msgspec.structs.replace(req, model_key=mk), None), R.PROVISIONING,
                        message=f"model {display_name(mk)} is being deployed")
            try:
                async with self._triage_deploys:
                    await self.admin.deploy(mk, self.default_replicas)
                log.info("provisioned", model_key=mk, replicas=self.default_replicas, by="first request")
            except errs.AlreadyDeployed:
                pass  # someone deployed it first: its consumer takes the requests
            except (errs.InvalidCommand, errs.NotFound) as exc:
                msg = f"cannot deploy {display_name(mk)}: {exc}"
                now = time.monotonic()
                _memo_put(self._refused, mk, (now + REFUSED_MODEL_MEMO_S, type(exc).__name__, msg), now)
                await self._refuse_stored(seq, data, raw.headers, type(exc).__name__, msg, user)
                continue
            except errs.NdifError as exc:  # no controller: the request stays; try again shortly
                log.warning("provision_failed", model_key=mk, error=str(exc))
                seq -= 1
                await asyncio.sleep(2.0)
                continue
            self._processor(token)  # deployed (by us or someone first): its consumer takes the requests
            return

    async def _refuse_stored(self, seq: int, data: bytes, headers: dict[str, str] | None, error: str,
                             message: str, user: str = "") -> None:
        """End a stored request that will never run: ERROR under its id (if it has a valid one), then
        delete it from the work queue (nothing else would ever take it)."""
        assert self.log_ is not None
        rid = _request_id_of(data) or _valid_id((headers or {}).get("Nats-Msg-Id", "").rsplit(".", 1)[-1])
        log.warning("request_refused", request_id=rid, error=error, message=message[:300])
        if rid:
            bogus = Request(request_id=rid, model_key="", payload={}, submitted_at=datetime.now(UTC), user=user)
            with contextlib.suppress(Exception):
                await self.finish(Pending(bogus, None), R.ERROR, error=error, message=message)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.log_.js.delete_msg(REQUESTS_STREAM, seq)

    async def remove_model(self, token_or_key: str, *, reason: str) -> bool:
        """Stop serving a model here: its waiting requests end ERROR (`reason`), its processor stops and
        its durable consumer `proc-<mtok>` is deleted. The undeploy path calls this (with the model key
        or its token); the dispatcher itself does for a model the log no longer knows. Returns whether
        a consumer was deleted."""
        assert self.log_ is not None
        token = model_token(token_or_key) if "{" in token_or_key else token_or_key  # keys hold JSON, tokens never
        p = self.processors.pop(token, None)
        task = self._consumers.pop(token, None)
        if task is not None:
            task.cancel()
        if p is not None:
            p.fail_all("ModelRemoved", reason)
            lanes = [t for ts in p.workers.values() for t in ts]
            for t in lanes:
                t.cancel()
            for running in p.in_flight.values():
                for held in running.values():
                    self.finish_soon(held, R.ERROR, error="ModelRemoved", message=reason)
        deleted = False
        with contextlib.suppress(nats.js.errors.NotFoundError):
            deleted = bool(await self.log_.js.delete_consumer(REQUESTS_STREAM, f"proc-{token}"))
        log.info("model_removed", token=token, reason=reason, consumer_deleted=deleted)
        return deleted

    async def sweep_consumers(self) -> list[str]:
        """Delete the durable consumers `proc-<mtok>` of models the log does not know, once seen unknown
        at two sweeps in a row (a model deployed a moment ago may not be in this fold yet)."""
        assert self.log_ is not None
        known = self._known_tokens()
        unknown: set[str] = set()
        for info in await self.log_.js.consumers_info(REQUESTS_STREAM):
            name = info.name or ""
            if name.startswith("proc-") and name[5:] not in known:
                unknown.add(name)
        gone = sorted(unknown & self._unknown_seen)
        self._unknown_seen = unknown - set(gone)
        for name in gone:
            await self.remove_model(name[5:], reason="the model is not in the log")
        return gone

    async def _route_stored(self) -> None:
        """Route every model subject that holds stored requests (no stream yet: nothing to route)."""
        assert self.log_ is not None
        with contextlib.suppress(nats.js.errors.NotFoundError):
            info = await self.log_.js.stream_info(REQUESTS_STREAM, subjects_filter=REQUESTS_ALL)
            for subject in (info.state.subjects or {}):
                token, _ = request_subject_parts(subject)
                if token:
                    self._route(token)

    async def _sweep_loop(self) -> None:
        assert self.log_ is not None
        while True:
            try:
                await self.sweep_consumers()
                # Level-triggered: any subject still holding requests gets its processor or a triage.
                await self._route_stored()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away: next time
                log.warning("consumer_sweep_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(UNKNOWN_CONSUMER_SWEEP_S)

    async def _consume(self, p: Processor) -> None:
        """Take the model's requests as they are stored (a continuous pull on its durable consumer)."""
        assert self.log_ is not None
        js = self.log_.js
        durable = f"proc-{p.token}"
        # A user's requests (`ndif.req.<mtok>.<user>`) and userless ones (an open server).
        filters = [f"ndif.req.{p.token}", f"ndif.req.{p.token}.*"]
        cfg = api.ConsumerConfig(durable_name=durable, filter_subjects=filters,
                                 ack_policy=api.AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_deliver=-1,
                                 max_ack_pending=100_000, deliver_policy=api.DeliverPolicy.ALL)

        async def on_msg(m: Msg) -> None:
            await self._accept(p, m)

        while True:
            try:
                if p.token not in self._known_tokens():
                    if time.monotonic() - p.born < KNOWN_GRACE_S:
                        await asyncio.sleep(0.1)  # deployed a moment ago: our fold has not seen it yet
                        continue
                    # Removed (undeployed): never make a consumer for a model the log does not know.
                    self.spawn(self.remove_model(p.token, reason="the model is no longer deployed"))
                    return
                try:
                    have = await js.consumer_info(REQUESTS_STREAM, durable)
                    if (sorted(have.config.filter_subjects or [have.config.filter_subject or ""]) != filters
                            or (have.config.ack_wait is not None and abs(have.config.ack_wait - self.ack_wait_s) > 0.01)):
                        await js.add_consumer(REQUESTS_STREAM, cfg)  # made by an older version or another ack wait
                except nats.js.errors.NotFoundError:
                    with contextlib.suppress(nats.js.errors.BadRequestError):  # made by a peer meanwhile
                        await js.add_consumer(REQUESTS_STREAM, cfg)
                pull = PullConsumer(self.log_.nc, REQUESTS_STREAM, durable, on_msg, batch=self.fetch_batch,
                                    hold=lambda: len(p.queue) >= MAX_HELD)  # re-checked every heartbeat
                await pull.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS away or consumer gone: make it again
                log.warning("consumer_restarting", token=p.token, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _accept(self, p: Processor, m: Msg) -> None:
        _, user = request_subject_parts(m.subject)
        try:
            req = decode_request(m.data)
            if req.user != user:
                req = msgspec.structs.replace(req, user=user)  # the owner is the subject's, never the body's
            mk = canonical_model_key(req.model_key, relative=False)  # the SDK sends it absolute
            if model_token(mk) != p.token:
                raise errs.InvalidCommand(f"request for {req.model_key!r} arrived on another model's subject")
        except errs.NdifError as exc:
            rid = _request_id_of(m.data) or _valid_id((m.headers or {}).get("Nats-Msg-Id", "").rsplit(".", 1)[-1])
            log.warning("request_refused", request_id=rid, error=str(exc)[:300])
            if rid:
                bogus = Request(request_id=rid, model_key="", payload={}, submitted_at=datetime.now(UTC), user=user)
                try:
                    await self.finish(Pending(bogus, m), R.ERROR, error=type(exc).__name__, message=str(exc))
                    return
                except Exception as werr:  # noqa: BLE001 - its status could not be kept: end it anyway
                    log.warning("request_refused_unrecorded", request_id=rid, error=str(werr))
            # No id a status could be kept under: nobody can be told, so it is terminated (never redelivered).
            with contextlib.suppress(Exception):
                await m.term()
            return
        if req.model_key != mk:
            req = msgspec.structs.replace(req, model_key=mk)
        attempt = int(m.metadata.num_delivered) if m.metadata else 1
        # Only a redelivery can find its terminal status already kept (a first delivery that does,
        # a request id re-sent past the dedup window, runs again and its compare-and-set loses).
        done = await self._terminal(status_key(req.request_id, user)) if attempt > 1 else None
        if done is not None:
            assert self.log_ is not None
            # Finished by an earlier delivery whose dispatcher died before acking: never run twice.
            # It may also have died before publishing, so the kept terminal status is published again
            # (same bytes; clients stop at the first terminal status they see).
            await self.log_.nc.publish(status_subject(req.request_id, user), encoder.encode(done))
            await m.ack()
            return
        if p.model_key is None:
            p.model_key = mk
            p.log = p.log.bind(model_key=mk)
            p.sync(queue_view(self.state, mk))
        p.enqueue(Pending(req, m, attempt=attempt))

    # ---- statuses out ------------------------------------------------------------------------

    async def _kept(self, request_id: str) -> tuple[StatusUpdate | None, int | None]:
        """The status kept in KV and its revision (None, None when there is none)."""
        try:
            e = await self.kv.get(request_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, None
        return (status_decoder.decode(e.value) if e.value else None), e.revision

    async def _terminal(self, request_id: str) -> StatusUpdate | None:
        cur, _ = await self._kept(request_id)
        return cur if cur is not None and cur.terminal else None

    def _update(self, p: Pending, status: RequestStatus, **kw: Any) -> StatusUpdate:
        return StatusUpdate(request_id=p.req.request_id, status=status, ts=datetime.now(UTC),
                            model_key=p.req.model_key, attempt=p.attempt, user=p.req.user, **kw)

    def status(self, p: Pending, status: RequestStatus, **kw: Any) -> None:
        """A non-terminal status: published always, kept in KV for the ones a reconnecting client needs.

        It never holds up the caller: publishes go out in order from one outbox task per loop turn.
        """
        if self._stopped:
            return
        u = self._update(p, status, **kw)
        data = encoder.encode(u)
        self._send(status_subject(u.request_id, u.user), data)
        if status in _KV_STATUSES:
            self._kv_put(u, data, terminal=False).add_done_callback(_retrieve)

    def _send(self, subject: str, data: bytes, reply: str = "") -> None:
        """Publish without holding up the caller: in order, from one outbox task per loop turn."""
        self._outbox.append((subject, data, reply))
        if self._outbox_task is None:
            self._outbox_task = asyncio.create_task(self._flush_outbox())
            self._bg.add(self._outbox_task)
            self._outbox_task.add_done_callback(self._bg.discard)

    async def _flush_outbox(self) -> None:
        assert self.log_ is not None
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                for subject, data, reply in batch:
                    await self.log_.nc.publish(subject, data, reply=reply)
        finally:
            self._outbox_task = None

    async def finish(self, p: Pending, status: RequestStatus, **kw: Any) -> bool:
        """The terminal status, written exactly once (CAS); then the request is acked.

        Kept by compare-and-set; the server republishes it on `ndif.status.[<user>.]<id>` as it is stored.
        """
        if status is R.COMPLETED and "result" in kw:
            body = msgspec.json.encode(kw["result"])
            if len(body) > INLINE_RESULT_BYTES:
                name = f"{status_key(p.req.request_id, p.req.user)}.json"
                try:
                    store = await self._results_store(p.req.user)
                except nats.errors.Error as exc:
                    # No bucket for this user and no right to make one (a client user added to
                    # the server without the config's dispatcher grant): say so, never drop it.
                    log.error("results_bucket_unavailable", request_id=p.req.request_id, user=p.req.user,
                              error=str(exc) or type(exc).__name__)
                    status, kw = R.ERROR, {k: v for k, v in kw.items() if k != "result"}
                    kw.update(error="ResultNotStored", message=f"the result ({len(body)} bytes) could not be "
                              f"stored: no results bucket for user {p.req.user!r} ({type(exc).__name__})")
                else:
                    await store.put(name, body)
                    kw = {**kw, "result": None, "result_ref": name}
        u = self._update(p, status, **kw)
        wrote = await self._kv_put(u, encoder.encode(u), terminal=True)
        if p.msg is not None:
            with contextlib.suppress(Exception):
                await p.msg.ack()
        return wrote

    async def _results_store(self, user: str) -> Any:
        """The Object Store bucket of `user`'s large results (`ndif_results_<user>`: only that client
        may read it), created on its first large result; the shared bucket without a user."""
        if not user:
            return self.results
        store = self._user_results.get(user)
        if store is None:
            assert self.log_ is not None
            bucket = results_bucket(user)
            try:
                store = await self.log_.js.object_store(bucket)
            except nats.js.errors.NotFoundError:
                store = await self.log_.js.create_object_store(bucket, config=api.ObjectStoreConfig(
                    bucket=bucket, replicas=self.log_.replicas, storage=api.StorageType.FILE))
            self._user_results[user] = store
        return store

    def finish_soon(self, p: Pending, status: RequestStatus, **kw: Any) -> None:
        """`finish` for a lane that goes on at once: the write starts now, the ack follows it from
        the outbox (no task of its own, unless the result is large and goes to the Object Store)."""
        if self._stopped:
            return  # not acked: redelivered to the next dispatcher
        u = self._update(p, status, **kw)
        data = encoder.encode(u)
        if len(data) > INLINE_RESULT_BYTES and u.result is not None:
            self.spawn(self.finish(p, status, **kw))
            return
        fut = self._kv_put(u, data, terminal=True)
        msg = p.msg
        if msg is not None and msg.reply:
            fut.add_done_callback(lambda f: self._ack_after(f, msg))

    def _ack_after(self, fut: asyncio.Future[bool], msg: Msg) -> None:
        if fut.cancelled():
            return  # stopping: redelivered
        if fut.exception() is not None:
            log.warning("terminal_status_not_kept", error=str(fut.exception()))  # not acked: redelivered
            return
        self._send(msg.reply, b"")  # the ack (what Msg.ack() sends), in order after the statuses

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
                self._start_writes(key, w)
            elif w.timer is None:
                # A status superseded within the delay is never written: a request that runs at
                # once costs one KV write (its terminal status), not three.
                w.timer = asyncio.get_running_loop().call_later(STATUS_KV_DELAY_S, self._start_writes, key, w)
        return fut

    def _start_writes(self, key: str, w: _Writes) -> None:
        w.timer = None
        if w.task is None and w.waiting is not None:
            w.task = asyncio.create_task(self._write_loop(key, w))
            self._bg.add(w.task)
            w.task.add_done_callback(self._bg.discard)

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
        for _ in range(20):
            try:
                new_rev = await (self.kv.create(key, data) if rev is None else self.kv.update(key, data, last=rev))
            except nats.js.errors.KeyWrongLastSequenceError:
                cur, rev = await self._kept(key)
                if cur is not None and cur.terminal:
                    return False
                continue
            if not terminal:
                self._rev[key] = new_rev
            return True
        if terminal:
            log.error("terminal_status_not_written", request_id=key)
        return False

    # ---- keep-alive, state, kill -------------------------------------------------------------

    async def _keepalive(self) -> None:
        """In-progress acks for every held request, well inside the ack wait."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for p in list(self.processors.values()):
                for held in p.held():
                    if held.msg is not None:
                        with contextlib.suppress(Exception):
                            await held.msg.in_progress()

    def get_state(self) -> list[dict[str, Any]]:
        return [p.state() for p in self.processors.values() if p.model_key is not None]

    async def _on_state(self, msg: Msg) -> None:
        if msg.reply:
            await msg.respond(msgspec.json.encode({"dispatcher": self.name, "processors": self.get_state()}))

    async def _on_kill(self, msg: Msg) -> None:
        request_id = msg.data.decode(errors="replace").strip()
        parts = msg.subject.split(".")
        user = parts[3] if len(parts) > 3 else None  # None: an admin's kill (`ndif.dispatcher.kill`)
        for p in self.processors.values():
            pend = p.cancel(request_id, user)
            if pend is not None:
                await self.finish(pend, R.ERROR, error="Cancelled", message="cancelled by `ndif kill`")
                if msg.reply:
                    await msg.respond(b'{"ok": true}')
                return
        if msg.reply:
            await msg.respond(msgspec.json.encode({"ok": False, "message": f"{request_id} is not queued or running "
                                                                          "here (finished, or never submitted)"}))


class _Writes:
    __slots__ = ("task", "timer", "waiting")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.waiting: tuple[StatusUpdate, bytes, bool, asyncio.Future[bool]] | None = None


def _retrieve(fut: asyncio.Future[bool]) -> None:
    """Nobody waits for a non-terminal status write: look at its outcome so a failure is logged once."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("status_not_kept", error=str(fut.exception()))


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


def _memo_put(memo: dict[str, tuple[float, str, str]], key: str, value: tuple[float, str, str], now: float,
              cap: int = MAX_REFUSED_MEMO) -> None:
    """Keep `value` (its first field: until when) under `key`; a full memo drops its expired entries,
    then its oldest, so it never holds more than `cap` (a flood of model names cannot grow it)."""
    if key not in memo and len(memo) >= cap:
        for k in [k for k, v in memo.items() if v[0] <= now]:
            del memo[k]
        while len(memo) >= cap:
            del memo[next(iter(memo))]
    memo[key] = value


def _valid_id(rid: str) -> str | None:
    try:
        return check_request_id(rid)
    except errs.InvalidCommand:
        return None


def _request_id_of(data: bytes) -> str | None:
    try:
        rid = msgspec.json.decode(data).get("request_id")
    except Exception:  # noqa: BLE001 - malformed bodies have no id
        return None
    try:
        return check_request_id(rid)
    except errs.InvalidCommand:
        return None


async def run_dispatcher(url: str, **kw: Any) -> None:
    async with Dispatcher(url, **kw):
        await asyncio.Event().wait()
