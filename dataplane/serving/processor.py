"""One model's processor (as in NDIF): one shared queue, and the lanes of every ready replica competing on it.

The queue is fair over users (controlplane/core/fairness.py: weights, priority bands, a running
limit per user; a user past its queued limit is refused at once with ERROR QueueLimitExceeded), and
queued requests are told their position and wait estimate as they move (`positions`).

A lane is one call at a time to one replica; each ready replica gets `lanes_per_replica` of them
(NDIF_REPLICA_LANES). The replica set is not the processor's own: `sync(view)` is called with the
queue view folded from the event log every time an event arrives, so `ReplicaLoaded` starts a
replica's lanes and an eviction, drain or failure retires them at once, without touching the
other replicas' lanes. A dispatcher calls a replica only once the log says it does
(`ReplicaServed`, appended through `serve` and folded back): a drain then knows whom to wait for. A lane takes a request from the head of the queue (with what waits behind
it, when requests are short), calls its replica, and writes the terminal status (exactly once);
if the replica went away under it (WARM, COLD, dead) the request goes back to the head of the
queue for another lane. A draining replica takes nothing new and, once idle, is reported
drained (`ReplicaDrained`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from controlplane.core.fairness import (
    FairnessPolicy,
    RequestQueue,
    position_update_due,
    request_queue,
    wait_estimate_s,
)
from controlplane.core.projections.queue import ModelQueueView, load_failed_for_good, processor_status
from dataplane.replica.model import ReplicaNotHot, error_text
from dataplane.replica.wire import Completed, NotRun, encode_call
from dataplane.runtime.ports import ReplicaCaller
from dataplane.serving.latency import LatencyHistogram
from dataplane.serving.link import NoEndpoint, ReplicaLink, ReplyLost
from dataplane.serving.ports import Delivery
from schemas.keys import display_name
from schemas.requests import Request
from schemas.status import ProcessorStatus, RequestStatus
from schemas.subjects import replica_call_subject, status_key

logger = structlog.get_logger("ndif.processor")
R = RequestStatus


class Pending:
    __slots__ = ("attempt", "cancelled", "msg", "received", "req", "sent_at", "sent_position")

    def __init__(self, req: Request, msg: Delivery | None, attempt: int = 1) -> None:
        self.req = req
        self.msg = msg
        self.attempt = attempt
        self.received = time.monotonic()
        self.cancelled = False
        self.sent_position: int | None = None  # the queue position its last QUEUED status said
        self.sent_at = 0.0


class StatusOut(Protocol):
    def __call__(self, p: Pending, status: RequestStatus, **kw: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class ProcessorHooks:
    """What a processor is given by its dispatcher (it never reaches back for anything else)."""

    status: StatusOut  # a non-terminal status out (published, kept in KV)
    finish_soon: StatusOut  # the terminal status, kept exactly once, then the ack
    provision: Callable[[Processor], None]  # requests wait: ask for replicas if none are asked for
    drained: Callable[[str, int], None]  # (model key, replica id): a draining replica went idle
    link: ReplicaLink | None  # replica calls over NATS; None: Ray calls only
    caller: ReplicaCaller  # calls into replicas through the runtime (the NATS link's fallback)
    lanes_per_replica: int  # calls a replica is handed at once (NDIF_REPLICA_LANES)
    batch_max: int  # short requests one call may carry
    batch_budget_s: float  # ... as many as run in this long, by the model's recent run times
    fairness: FairnessPolicy = field(default_factory=FairnessPolicy)  # shares, bands, limits per user (NDIF_FAIRNESS)
    position_every_s: float = 1.0  # a queued request hears of its new position at most this often
    # (model key, replica id): say in the log that this dispatcher (`name`) calls the replica; its
    # lanes start once the fold holds that. None: every Available replica is called at once.
    serve: Callable[[str, int], None] | None = None
    name: str = ""


_Call = tuple[int, list[Pending], Any, Any]  # replica id, its requests, its actor, the call (or why it could not start)


def _replica_gone(exc: BaseException, caller: ReplicaCaller) -> bool:
    """Did the call fail because the replica left (WARM, COLD, dead), not because of the request?"""
    if isinstance(exc, ReplicaNotHot) or caller.gone(exc):
        return True
    return isinstance(getattr(exc, "cause", None), ReplicaNotHot)


class Processor:
    def __init__(self, token: str, hooks: ProcessorHooks) -> None:
        self.caller = hooks.caller
        self.token = token
        self.model_key: str | None = None
        self.hooks = hooks
        self.queue: RequestQueue[Pending] = request_queue(hooks.fairness, lambda p: p.req.user)
        self.view: ModelQueueView | None = None
        self.lanes: dict[int, list[asyncio.Task[None]]] = {}  # replica id -> its lane tasks
        # replica id -> `<user>.<request id>` (status_key: ids are each user's own) -> request
        self.in_flight: dict[int, dict[str, Pending]] = {}
        self.lanes_per_replica = hooks.lanes_per_replica
        self.ready: set[int] = set()
        self.nodes: dict[int, str] = {}  # replica id -> its node (its endpoint is `ndif.run.<ntok>.<mtok>.<rid>`)
        self.draining: set[int] = set()
        self.provisioning = False
        self.provision_not_before = 0.0  # monotonic time before which no new deploy is sent
        self.provision_backoff_s = 0.0
        self.status = ProcessorStatus.UNINITIALIZED
        self.completed = 0
        self.calls = 0  # replica calls made (a call may carry several short requests)
        self.link_calls = 0  # of which over the replica's NATS endpoint (the others through Ray)
        self.errors = 0
        self.latency = LatencyHistogram()  # taken -> terminal answer, of requests answered here
        self._idle: collections.deque[tuple[int, asyncio.Future[_Call | None]]] = collections.deque()  # idle lanes
        self._prefer: dict[int, int] = {}  # replica id -> its place in this dispatcher's tie-break order
        self._turn = 0  # picks made: ties rotate over the replicas (light load reaches every one)
        self._actors: dict[int, Any] = {}
        self.express: set[asyncio.Task[None]] = set()  # calls made beyond the lanes (`_express`)
        self.express_calls = 0
        self.exec_s: float | None = None  # recent run time of one request on a replica (moving average)
        self.logger = logger.bind(model_key=None, token=token)
        self.born = time.monotonic()

    # ---- the replica set, from the log -------------------------------------------------------

    def sync(self, view: ModelQueueView) -> None:
        self.view = view
        ready = set(view.ready)
        if self.hooks.serve is not None:
            # Called only once the log says so: a drain waits for this dispatcher from then on.
            claimed = {rid for rid, by in view.served_by if self.hooks.name in by}
            for rid in sorted(ready - claimed):
                self.hooks.serve(self.model_key or "", rid)
            ready &= claimed
        self.draining = set(view.draining)
        gone = self.ready - ready
        self.ready = ready
        # Ties among equally loaded replicas: this dispatcher's rank among those that serve the
        # model (from the log, so every dispatcher has the same list) rotates its order of them.
        names = sorted({n for _, by in view.served_by for n in by})
        rank = names.index(self.hooks.name) if self.hooks.name in names else 0
        order = sorted(ready)
        self._prefer = {rid: (i - rank) % len(order) for i, rid in enumerate(order)}
        self.nodes = dict(view.nodes)
        for rid in ready - set(self.lanes):
            self.lanes[rid] = [asyncio.create_task(self._lane(rid), name=f"lane-{self.token}-{rid}-{i}")
                               for i in range(self.lanes_per_replica)]
            self.logger.info("lanes_started", replica_id=rid, lanes=self.lanes_per_replica)
        for rid in gone:
            self._actors.pop(rid, None)
        for rid in self.draining:
            if not self.in_flight.get(rid):
                self.hooks.drained(self.model_key or "", rid)
        self._refresh_status()
        self._notify(everyone=True)  # lanes of replicas that left must see it and retire

    def _refresh_status(self) -> None:
        if self.queue and self.view is not None and load_failed_for_good(self.view):
            # Waiting would be for ever: end them now, saying what an operator must do.
            name = display_name(self.view.model_key)
            ids = ", ".join(map(str, self.view.load_failed))
            self.fail_all("ModelLoadFailed", f"every replica of {name} failed to load (replica {ids}); "
                          f"`ndif status {name}` shows why; after fixing the checkpoint, `ndif restart {name}` "
                          "or deploy it again")
        if self.view is None:
            new = ProcessorStatus.PROVISIONING if (self.queue or self.provisioning) else ProcessorStatus.UNINITIALIZED
        else:
            new = processor_status(self.view, in_flight=self.running(), queued=len(self.queue),
                                   provisioning=self.provisioning)
        if new is not self.status:
            self.status = new
            if new in (ProcessorStatus.PROVISIONING, ProcessorStatus.DEPLOYING):
                waiting = R.PROVISIONING if new is ProcessorStatus.PROVISIONING else R.DEPLOYING
                for p in list(self.queue):
                    self.hooks.status(p, waiting, message=f"model is {new.lower()}")
        self.hooks.provision(self)

    # ---- requests ----------------------------------------------------------------------------

    def enqueue(self, p: Pending) -> None:
        """A request taken from the stream: queued fairly, or refused at once when its user already
        holds its limit of queued requests here (a redelivery is never refused: it was admitted)."""
        if p.attempt == 1:
            refused = self.queue.admit(p.req.user)
            if refused is not None:
                self.hooks.finish_soon(p, R.ERROR, error="QueueLimitExceeded", message=refused.message(
                    self.model_key or "this model"), limit=refused.limit, count=refused.count)
                return
        self.queue.push(p)
        # Lanes waiting: the calls to their replicas start now (the request this lane takes may be
        # another user's, by fair share); a request taken at once never queued, so no QUEUED.
        while self.queue.ready() and (lane := self._idle_lane()) is not None:
            rid, fut = lane
            nxt = self.queue.pop()
            assert nxt is not None
            fut.set_result(self._submit(rid, [nxt]))
        pos = self.queue.position(p)
        if pos == 0:
            self._express(p)
            pos = self.queue.position(p)
        if pos is not None:
            self._tell_position(p, pos, time.monotonic())
        self._refresh_status()
        self._notify()

    def _express(self, p: Pending) -> None:
        """The head of the queue, of a user with nothing running here, does not wait for a lane to
        end its call when every lane is busy: it gets a call of its own to the least loaded replica,
        whose turns run it next (the user served least recently there: dataplane/replica/turns.py).
        So a light user's request waits for the run in progress, not for the calls the lanes hold.
        At most one such call per ready replica at once; a user with a request running never gets
        one (a flood keeps to its lanes)."""
        ready = sorted(self.ready - self.draining)
        if not ready or len(self.express) >= len(ready) or self.queue.running(p.req.user):
            return
        nxt = self.queue.pop()
        if nxt is not p:  # the head by position is not what the queue gives next (a running limit)
            if nxt is not None:
                self.queue.push_back(nxt)
            return
        n = len(self._prefer) or 1
        rid = min(ready, key=lambda r: (len(self.in_flight.get(r, ())), (self._prefer.get(r, 0) - self._turn) % n))
        call = self._submit(rid, [p])
        if call is None:
            return  # its actor is gone: back in the queue, for the lanes
        self.express_calls += 1
        task = asyncio.create_task(self._answers(call), name=f"express-{self.token}-{rid}")
        self.express.add(task)
        task.add_done_callback(self.express.discard)

    def tasks(self) -> list[asyncio.Task[None]]:
        """Every task calling replicas for this processor (its lanes, its calls beyond them)."""
        return [*(t for ts in self.lanes.values() for t in ts), *self.express]

    def _tell_position(self, p: Pending, pos: int, now: float) -> None:
        p.sent_position, p.sent_at = pos, now
        self.hooks.status(p, R.QUEUED, queue_position=pos,
                          wait_estimate_s=wait_estimate_s(pos, self.exec_s, len(self.ready)))

    def positions(self, now: float, budget: int = 1000) -> int:
        """Tell queued requests whose position moved enough (rate-limited per request, at most
        `budget` statuses per call); returns how many were sent."""
        sent = 0
        if not self.queue or self.status not in (ProcessorStatus.READY, ProcessorStatus.BUSY):
            return 0  # waiting for a replica: their status says so (PROVISIONING / DEPLOYING)
        for pos, p in enumerate(self.queue):
            if sent >= budget:
                break
            if position_update_due(p.sent_position, pos, now - p.sent_at, self.hooks.position_every_s):
                self._tell_position(p, pos, now)
                sent += 1
        return sent

    def cancel(self, request_id: str, user: str | None = None) -> Pending | None:
        """Take a queued request out, or mark a running one cancelled; `user`: only if it is theirs."""
        for p in list(self.queue):
            if p.req.request_id == request_id and (user is None or p.req.user == user):
                self.queue.remove(p)
                self._notify()
                return p
        for running in self.in_flight.values():
            for r in running.values():
                if r.req.request_id == request_id and (user is None or r.req.user == user):
                    r.cancelled = True
                    return r
        return None

    def fail_all(self, error: str, message: str) -> None:
        for p in list(self.queue):
            self.queue.remove(p)
            self.hooks.finish_soon(p, R.ERROR, error=error, message=message)

    def fail_user(self, user: str, error: str, message: str) -> None:
        """End `user`'s waiting requests (a refusal that is that user's alone)."""
        for p in list(self.queue):
            if p.req.user == user:
                self.queue.remove(p)
                self.hooks.finish_soon(p, R.ERROR, error=error, message=message)

    def held(self) -> list[Pending]:
        return [*self.queue, *(p for running in self.in_flight.values() for p in running.values())]

    def running(self) -> int:
        return sum(len(r) for r in self.in_flight.values())

    def _notify(self, *, everyone: bool = False) -> None:
        """Wake as many idle lanes as there are queued requests, least loaded replicas first (all of
        them when the set changed)."""
        if everyone:
            while self._idle:
                _, fut = self._idle.popleft()
                if not fut.done():
                    fut.set_result(None)
            return
        for _ in range(min(len(self.queue), len(self._idle)) if self.queue.ready() else 0):
            lane = self._idle_lane()
            if lane is None:
                break
            lane[1].set_result(None)

    def _idle_lane(self) -> tuple[int, asyncio.Future[_Call | None]] | None:
        """Take the idle lane a request should go to: of the ready replica with the fewest requests
        outstanding from this dispatcher (least outstanding), ties broken by this dispatcher's own
        order of the replicas (`_prefer`) rotated by one at each pick, so that dispatchers at low load
        start on different replicas and light load still reaches every replica (a replica placed
        again after a loss serves as soon as it is ready). Lanes of replicas that left are let go on
        the way. None: no idle lane."""
        best: tuple[tuple[int, int], tuple[int, asyncio.Future[_Call | None]]] | None = None
        keep: collections.deque[tuple[int, asyncio.Future[_Call | None]]] = collections.deque()
        for lane in self._idle:
            rid, fut = lane
            if fut.done():
                continue
            if rid not in self.ready:
                fut.set_result(None)  # that lane's replica left: let it retire
                continue
            keep.append(lane)
            n = len(self._prefer) or 1
            key = (len(self.in_flight.get(rid, ())), (self._prefer.get(rid, 0) - self._turn) % n)
            if best is None or key < best[0]:
                best = (key, lane)
        if best is not None:
            keep.remove(best[1])
            self._turn += 1  # the next tie goes to the next replica in this dispatcher's order
        self._idle = keep
        return best[1] if best is not None else None

    async def _lane(self, rid: int) -> None:
        """One lane of replica `rid`: a call with the head of the queue (and what waits behind it,
        when requests are short), its answers, repeat."""
        me = asyncio.current_task()
        try:
            while rid in self.ready:
                call = await self._next(rid)
                if call is None:
                    break
                await self._answers(call)
        finally:
            mine = self.lanes.get(rid, [])
            if me in mine:
                mine.remove(me)  # type: ignore[arg-type]
            if not mine:
                self.lanes.pop(rid, None)
                self.logger.info("lanes_retired", replica_id=rid)
            if rid in self.draining and not self.in_flight.get(rid):
                self.hooks.drained(self.model_key or "", rid)

    async def _next(self, rid: int) -> _Call | None:
        """The lane's next call, started: from the queue, or handed over by `enqueue`."""
        while rid in self.ready:
            first = self.queue.pop()
            if first is not None:
                batch = [first]
                limit = self._batch_limit()
                while len(batch) < limit and (nxt := self.queue.pop()) is not None:
                    batch.append(nxt)
                call = self._submit(rid, batch)
                if call is not None:
                    return call
                continue
            fut: asyncio.Future[_Call | None] = asyncio.get_running_loop().create_future()
            self._idle.append((rid, fut))
            try:
                got = await fut
            except asyncio.CancelledError:
                fut.cancel()  # stopping: a call handed over meanwhile is not acked, so it is redelivered
                raise
            if got is not None:
                return got
        self._notify()  # this lane's replica left: a wake-up meant for work goes to another lane
        return None

    def _batch_limit(self) -> int:
        """How many waiting requests one call takes: as many as run in the batch budget, judged by
        how long this model's requests ran lately (1 until one has run, and for slow models)."""
        if self.exec_s is None:
            return 1
        return max(1, min(self.hooks.batch_max, int(self.hooks.batch_budget_s / max(self.exec_s, 1e-6))))

    def _submit(self, rid: int, batch: list[Pending]) -> _Call | None:
        """Start the call to replica `rid` (None if its actor is gone: the batch went back to the queue)."""
        assert self.model_key is not None
        running = self.in_flight.setdefault(rid, {})
        for p in batch:
            running[status_key(p.req.request_id, p.req.user)] = p
        actor = self._actors.get(rid) or self.caller.lookup(self.model_key, rid)
        if actor is None:
            self._requeue(rid, batch, "RayActorError")  # first: back in its place, no longer running
            self._release(rid, batch)
            return None
        self._actors[rid] = actor
        try:
            ref = self._call(rid, actor, [p.req.payload for p in batch], [p.req.user for p in batch])
        except Exception as exc:  # noqa: BLE001 - e.g. a payload Ray cannot serialize: answered below
            ref = exc
        self.calls += 1
        # Status writes are not on the request's path: RUNNING goes out while the replica works
        # (the KV compare-and-set keeps it from ever overwriting the terminal status).
        for p in batch:
            self.hooks.status(p, R.RUNNING, replica_id=rid)
        self._refresh_status()
        return rid, batch, actor, ref

    def _call(self, rid: int, actor: Any, payloads: list[dict[str, Any]], users: list[str]) -> Any:
        """Start a replica call: over its NATS endpoint when it has one (dataplane/serving/link.py),
        else a Ray call. Either is awaited for the same answers."""
        link = self.hooks.link
        if link is not None:
            assert self.model_key is not None
            key = (self.model_key, rid)
            body = encode_call(payloads, users)
            if link.usable(key, len(body)):
                self.link_calls += 1
                subject = replica_call_subject(self.model_key, rid, self.nodes.get(rid, ""))
                return link.call(key, subject, actor, body)
        return self.caller.run_batch(actor, payloads, users)

    def _release(self, rid: int, batch: list[Pending]) -> None:
        running = self.in_flight.get(rid, {})
        for p in batch:
            running.pop(status_key(p.req.request_id, p.req.user), None)
            self.queue.release(p)  # nothing when it went back to the queue
        if not running and rid in self.in_flight:
            del self.in_flight[rid]
        if rid in self.draining and not self.in_flight.get(rid):
            self.hooks.drained(self.model_key or "", rid)
        self._refresh_status()
        self._notify()  # a user held back by its running limit may go now

    def _requeue(self, rid: int, batch: list[Pending], reason: str, *, replica_left: bool = True) -> None:
        """The replica left under these requests (or lost their answers): back to the queue, each in
        the place its fair-share tag gives it (ahead of its user's later requests)."""
        if replica_left:
            self._actors.pop(rid, None)
            self.ready.discard(rid)  # until the log says otherwise
        for p in batch:
            p.attempt += 1
            self.queue.push_back(p)
            self.logger.info("request_requeued", request_id=p.req.request_id, replica_id=rid, reason=reason)
        self._notify(everyone=True)

    def _error(self, p: Pending, rid: int, error: str, message: str) -> None:
        self.errors += 1
        self.latency.observe(time.monotonic() - p.received)
        self.hooks.finish_soon(p, R.ERROR, replica_id=rid, error=error, message=message)

    async def _answers(self, call: _Call) -> None:
        rid, batch, actor, ref = call
        try:
            try:
                if isinstance(ref, Exception):
                    raise ref
                try:
                    answers = await ref
                except NoEndpoint:
                    # No endpoint on NATS (made without one, or its connection is down): the same
                    # call through Ray (`_call` skips the endpoint while it is marked absent).
                    assert self.hooks.link is not None and self.model_key is not None
                    self.hooks.link.endpoint_absent((self.model_key, rid))
                    answers = await self._call(rid, actor, [p.req.payload for p in batch], [p.req.user for p in batch])
            except Exception as exc:  # noqa: BLE001 - sorted below: the replica's fault or the call's
                if isinstance(exc, ReplyLost):
                    self._requeue(rid, batch, "ReplyLost", replica_left=False)
                    return
                if _replica_gone(exc, self.caller):
                    self._requeue(rid, batch, type(exc).__name__)
                    return
                cause = getattr(exc, "cause", None) or exc
                for p in batch:
                    if not p.cancelled:
                        self._error(p, rid, type(cause).__name__, error_text(cause))
                return
            not_run = []
            for p, a in zip(batch, answers, strict=True):
                if isinstance(a, NotRun):
                    not_run.append(p)
                    continue
                if isinstance(a, Completed):
                    # The run time of completed requests only: a failure's time may hold its wait for
                    # a turn, or be a refusal before anything ran.
                    seconds = a.seconds
                    self.exec_s = seconds if self.exec_s is None else 0.8 * self.exec_s + 0.2 * seconds
                if p.cancelled:
                    continue  # its terminal status (cancelled) is already written
                if isinstance(a, Completed):
                    self.completed += 1
                    self.latency.observe(time.monotonic() - p.received)
                    # The replica is free once it answered: the terminal status and the ack go out
                    # while this lane takes the next request.
                    self.hooks.finish_soon(p, R.COMPLETED, replica_id=rid, result=a.result)
                else:
                    self._error(p, rid, a.error, a.message)
            if not_run:
                self._requeue(rid, not_run, "ReplicaNotHot")
        finally:
            self._release(rid, batch)

    def state(self) -> dict[str, Any]:
        """The processor's state for `ndif queue` (NDIF's `get_state()` fields; docs/cli.md lists them)."""
        v = self.view
        return {
            "model_key": self.model_key, "status": str(self.status), "queued": len(self.queue),
            "in_flight": self.running(), "lanes_per_replica": self.lanes_per_replica, "ready_replicas": sorted(self.ready),
            "draining_replicas": sorted(self.draining), "starting_replicas": list(v.starting) if v else [],
            "replica_count": v.replica_count if v else 0, "serving_replicas": sorted(self.lanes),
            "completed": self.completed, "errors": self.errors, "replica_calls": self.calls,
            "endpoint_calls": self.link_calls, "express_calls": self.express_calls,
            "run_ms": round(self.exec_s * 1000, 3) if self.exec_s is not None else None, "provisioning": self.provisioning,
            # Seconds the longest-held queued request has waited here (since this dispatcher took it).
            # Per user: requests queued and running here (the 50 holding most).
            "users": {u: {"queued": q, "running": r} for u, (q, r) in sorted(
                self.queue.users().items(), key=lambda kv: -sum(kv[1]))[:50]},
            "oldest_wait_s": round(time.monotonic() - min(p.received for p in self.queue), 3) if self.queue else None,
            # Completion latency (dataplane/serving/latency.py): cumulative, readers take differences.
            "latency_s": self.latency.snapshot(),
        }


def idle_replicas_with_queue(procs: list[Processor]) -> int:
    """How many ready replicas of one model have no request outstanding from any of `procs` (the
    model's processors, one per dispatcher) while requests of the model wait: queued at a dispatcher,
    or handed to another replica behind the one it runs. What the lane choice keeps at 0
    (tools/bench/fairness.py adds it up over time)."""
    ready: set[int] = set().union(*(p.ready for p in procs)) if procs else set()
    out = {rid: sum(len(p.in_flight.get(rid, {})) for p in procs) for rid in ready}
    return idle_with_queue(out, any(len(p.queue) for p in procs))


def idle_with_queue(outstanding: dict[int, int], queued: bool) -> int:
    """`idle_replicas_with_queue` from its figures: each ready replica's calls outstanding (from
    every dispatcher) and whether any dispatcher has requests of the model queued."""
    idle = sum(n == 0 for n in outstanding.values())
    if not idle:
        return 0
    waiting = queued or any(n > 1 for n in outstanding.values())
    return idle if waiting else 0
