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
        self.workers: dict[int, asyncio.Task[None]] = {}
        self.in_flight: dict[int, Pending] = {}
        self.ready: set[int] = set()
        self.draining: set[int] = set()
        self.provisioning = False
        self.status = ProcessorStatus.UNINITIALIZED
        self.completed = 0
        self.errors = 0
        self._wake = asyncio.Condition()
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
            self.workers[rid] = asyncio.create_task(self._worker(rid), name=f"worker-{self.token}-{rid}")
            self.log.info("worker_added", replica_id=rid)
        for rid in gone:
            self._actors.pop(rid, None)
        for rid in self.draining:
            if rid not in self.in_flight:
                self.d.report_drained(self.model_key or "", rid)
        self._refresh_status()
        self._notify()

    def _refresh_status(self) -> None:
        if self.view is None:
            new = ProcessorStatus.PROVISIONING if (self.queue or self.provisioning) else ProcessorStatus.UNINITIALIZED
        else:
            new = processor_status(self.view, in_flight=len(self.in_flight), queued=len(self.queue),
                                   provisioning=self.provisioning)
        if new is not self.status:
            self.status = new
            if new in (ProcessorStatus.PROVISIONING, ProcessorStatus.DEPLOYING):
                waiting = R.PROVISIONING if new is ProcessorStatus.PROVISIONING else R.DEPLOYING
                for p in list(self.queue):
                    self.d.spawn(self.d.status(p, waiting, message=f"model is {new.lower()}"))
        self.d.maybe_provision(self)

    # ---- requests ----------------------------------------------------------------------------

    def enqueue(self, p: Pending, *, head: bool = False) -> None:
        if head:
            self.queue.appendleft(p)
        else:
            self.queue.append(p)
        self.d.spawn(self.d.status(p, R.QUEUED, queue_position=0 if head else len(self.queue) - 1))
        self._refresh_status()
        self._notify()

    def cancel(self, request_id: str) -> Pending | None:
        for p in list(self.queue):
            if p.req.request_id == request_id:
                self.queue.remove(p)
                return p
        for p in self.in_flight.values():
            if p.req.request_id == request_id:
                p.cancelled = True
                return p
        return None

    def fail_all(self, error: str, message: str) -> None:
        while self.queue:
            p = self.queue.popleft()
            self.d.spawn(self.d.finish(p, R.ERROR, error=error, message=message))

    def held(self) -> list[Pending]:
        return [*self.queue, *self.in_flight.values()]

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._wake:
                self._wake.notify_all()

        self.d.spawn(wake())

    async def _next(self, rid: int) -> Pending | None:
        async with self._wake:
            while not self.queue and rid in self.ready:
                await self._wake.wait()
            if rid not in self.ready:
                return None
            return self.queue.popleft()

    async def _worker(self, rid: int) -> None:
        try:
            while rid in self.ready:
                p = await self._next(rid)
                if p is None:
                    break
                await self._run(rid, p)
        finally:
            self.workers.pop(rid, None)
            if rid in self.draining and rid not in self.in_flight:
                self.d.report_drained(self.model_key or "", rid)
            self.log.info("worker_retired", replica_id=rid)

    async def _run(self, rid: int, p: Pending) -> None:
        assert self.model_key is not None
        self.in_flight[rid] = p
        self._refresh_status()
        try:
            actor = self._actors.get(rid) or get_actor(self.model_key, rid)
            if actor is None:
                raise ray.exceptions.RayActorError()
            self._actors[rid] = actor
            # Status writes are not on the request's path: RUNNING goes out while the replica works
            # (the KV compare-and-set keeps it from ever overwriting the terminal status).
            self.d.spawn(self.d.status(p, R.RUNNING, replica_id=rid))
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
                    self._notify()
                    return
                cause = getattr(exc, "cause", None) or exc
                self.errors += 1
                await self.d.finish(p, R.ERROR, replica_id=rid, error=type(cause).__name__,
                                    message=str(cause).strip().splitlines()[-1][:1000] if str(cause).strip()
                                    else type(cause).__name__)
                return
            if p.cancelled:
                return  # its terminal status (cancelled) is already written
            self.completed += 1
            await self.d.finish(p, R.COMPLETED, replica_id=rid, result=result)
        finally:
            self.in_flight.pop(rid, None)
            if rid in self.draining:
                self.d.report_drained(self.model_key, rid)
            self._refresh_status()

    def state(self) -> dict[str, Any]:
        """Seed 000's `get_state()` fields, for `ndif queue`."""
        v = self.view
        return {
            "model_key": self.model_key, "status": str(self.status), "queued": len(self.queue),
            "in_flight": len(self.in_flight), "ready_replicas": sorted(self.ready),
            "draining_replicas": sorted(self.draining), "starting_replicas": list(v.starting) if v else [],
            "requested_replicas": v.requested if v else 0, "workers": sorted(self.workers),
            "completed": self.completed, "errors": self.errors, "provisioning": self.provisioning,
        }
