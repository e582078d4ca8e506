"""One model's processor (seed 000): one shared queue, one worker per ready replica competing on it.

The replica set is not the processor's own: `sync(view)` is called with the queue view folded from
the event log every time an event arrives, so `ReplicaLoaded` adds a worker and an eviction, drain
or failure retires one at once, without touching the other workers. A worker takes a request from
the head of the queue, calls its replica's actor, and writes the terminal status (exactly once);
if the replica went away under it (WARM, COLD, dead) the request goes back to the head of the
queue for another worker. A draining replica takes nothing new and, once idle, is reported
drained (`ReplicaDrained`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Any

import ray
import structlog
from nats.aio.msg import Msg

from controlplane.projections.queue import ModelQueueView, processor_status
from dataplane.model import ReplicaNotHot
from dataplane.model_actor import get_actor
from schemas.requests import Request
from schemas.status import ProcessorStatus, RequestStatus

if TYPE_CHECKING:
    from dataplane.dispatcher import Dispatcher

log = structlog.get_logger("ndif.processor")
R = RequestStatus


class Pending:
    __slots__ = ("attempt", "cancelled", "msg", "received", "req")

    def __init__(self, req: Request, msg: Msg | None, attempt: int = 1) -> None:
        self.req = req
        self.msg = msg
        self.attempt = attempt
        self.received = time.monotonic()
        self.cancelled = False


def _replica_gone(exc: BaseException) -> bool:
    """Did the call fail because the replica left (WARM, COLD, dead), not because of the request?"""
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError, ReplicaNotHot)):
        return True
    return isinstance(getattr(exc, "cause", None), ReplicaNotHot)


class Processor:
    def __init__(self, token: str, dispatcher: Dispatcher) -> None:
        self.token = token
        self.model_key: str | None = None
        self.d = dispatcher
        self.queue: collections.deque[Pending] = collections.deque()
        self.view: ModelQueueView | None = None
        self.workers: dict[int, list[asyncio.Task[None]]] = {}  # replica id -> its lanes
        self.in_flight: dict[int, dict[str, Pending]] = {}  # replica id -> request id -> request
        self.lanes = dispatcher.replica_lanes
        self.ready: set[int] = set()
        self.draining: set[int] = set()
        self.provisioning = False
        self.provision_not_before = 0.0  # monotonic time before which no new deploy is sent
        self.provision_backoff_s = 0.0
        self.status = ProcessorStatus.UNINITIALIZED
        self.completed = 0
        self.errors = 0
        self._idle: collections.deque[asyncio.Future[None]] = collections.deque()  # lanes waiting for work
        self._actors: dict[int, Any] = {}
        self.log = log.bind(model_key=None, token=token)

    # ---- the replica set, from the log -------------------------------------------------------

    def sync(self, view: ModelQueueView) -> None:
        self.view = view
        ready = set(view.ready)
        self.draining = set(view.draining)
        gone = self.ready - ready
        self.ready = ready
        for rid in ready - set(self.workers):
            self.workers[rid] = [asyncio.create_task(self._worker(rid), name=f"worker-{self.token}-{rid}-{lane}")
                                 for lane in range(self.lanes)]
            self.log.info("worker_added", replica_id=rid, lanes=self.lanes)
        for rid in gone:
            self._actors.pop(rid, None)
        for rid in self.draining:
            if not self.in_flight.get(rid):
                self.d.report_drained(self.model_key or "", rid)
        self._refresh_status()
        self._notify(everyone=True)  # lanes of replicas that left must see it and retire

    def _refresh_status(self) -> None:
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
                    self.d.status(p, waiting, message=f"model is {new.lower()}")
        self.d.maybe_provision(self)

    # ---- requests ----------------------------------------------------------------------------

    def enqueue(self, p: Pending, *, head: bool = False) -> None:
        if head:
            self.queue.appendleft(p)
        else:
            self.queue.append(p)
        self.d.status(p, R.QUEUED, queue_position=0 if head else len(self.queue) - 1)
        self._refresh_status()
        self._notify()

    def cancel(self, request_id: str) -> Pending | None:
        for p in list(self.queue):
            if p.req.request_id == request_id:
                self.queue.remove(p)
                return p
        for running in self.in_flight.values():
            p = running.get(request_id)
            if p is not None:
                p.cancelled = True
                return p
        return None

    def fail_all(self, error: str, message: str) -> None:
        while self.queue:
            p = self.queue.popleft()
            self.d.spawn(self.d.finish(p, R.ERROR, error=error, message=message))

    def held(self) -> list[Pending]:
        return [*self.queue, *(p for running in self.in_flight.values() for p in running.values())]

    def running(self) -> int:
        return sum(len(r) for r in self.in_flight.values())

    def _notify(self, *, everyone: bool = False) -> None:
        """Wake as many idle lanes as there are queued requests (all of them when the set changed)."""
        n = len(self._idle) if everyone else min(len(self.queue), len(self._idle))
        for _ in range(n):
            fut = self._idle.popleft()
            if not fut.done():
                fut.set_result(None)

    async def _next(self, rid: int) -> Pending | None:
        while rid in self.ready:
            if self.queue:
                return self.queue.popleft()
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                fut.cancel()
                raise
        self._notify()  # this lane's replica left: a wake-up meant for work goes to another lane
        return None

    async def _worker(self, rid: int) -> None:
        """One lane of replica `rid`: take the head of the queue, run it there, repeat."""
        me = asyncio.current_task()
        try:
            while rid in self.ready:
                p = await self._next(rid)
                if p is None:
                    break
                await self._run(rid, p)
        finally:
            lanes = self.workers.get(rid, [])
            if me in lanes:
                lanes.remove(me)  # type: ignore[arg-type]
            if not lanes:
                self.workers.pop(rid, None)
                self.log.info("worker_retired", replica_id=rid)
            if rid in self.draining and not self.in_flight.get(rid):
                self.d.report_drained(self.model_key or "", rid)

    async def _run(self, rid: int, p: Pending) -> None:
        assert self.model_key is not None
        running = self.in_flight.setdefault(rid, {})
        running[p.req.request_id] = p
        self._refresh_status()
        try:
            actor = self._actors.get(rid) or get_actor(self.model_key, rid)
            if actor is None:
                raise ray.exceptions.RayActorError()
            self._actors[rid] = actor
            # Status writes are not on the request's path: RUNNING goes out while the replica works
            # (the KV compare-and-set keeps it from ever overwriting the terminal status).
            self.d.status(p, R.RUNNING, replica_id=rid)
            try:
                result = await actor.__call__.remote(p.req.payload)
            except Exception as exc:  # noqa: BLE001 - sorted below: the replica's fault or the request's
                if _replica_gone(exc):
                    self._actors.pop(rid, None)
                    self.ready.discard(rid)  # until the log says otherwise
                    p.attempt += 1
                    self.log.info("request_requeued", request_id=p.req.request_id, replica_id=rid,
                                  reason=type(exc).__name__)
                    self.queue.appendleft(p)
                    self._notify(everyone=True)
                    return
                cause = getattr(exc, "cause", None) or exc
                self.errors += 1
                self.d.spawn(self.d.finish(p, R.ERROR, replica_id=rid, error=type(cause).__name__,
                                           message=str(cause).strip().splitlines()[-1][:1000] if str(cause).strip()
                                           else type(cause).__name__))
                return
            if p.cancelled:
                return  # its terminal status (cancelled) is already written
            self.completed += 1
            # The replica is free once it answered: the terminal status and the ack go out while
            # this lane takes the next request.
            self.d.spawn(self.d.finish(p, R.COMPLETED, replica_id=rid, result=result))
        finally:
            running.pop(p.req.request_id, None)
            if not running and self.in_flight.get(rid) is running:
                del self.in_flight[rid]
            if rid in self.draining and not self.in_flight.get(rid):
                self.d.report_drained(self.model_key, rid)
            self._refresh_status()

    def state(self) -> dict[str, Any]:
        """Seed 000's `get_state()` fields, for `ndif queue`."""
        v = self.view
        return {
            "model_key": self.model_key, "status": str(self.status), "queued": len(self.queue),
            "in_flight": self.running(), "lanes_per_replica": self.lanes, "ready_replicas": sorted(self.ready),
            "draining_replicas": sorted(self.draining), "starting_replicas": list(v.starting) if v else [],
            "requested_replicas": v.requested if v else 0, "workers": sorted(self.workers),
            "completed": self.completed, "errors": self.errors, "provisioning": self.provisioning,
        }
