"""Following the log: the dispatcher's fold, and each processor's replica set kept in step with it.

Every batch of events is folded with the same reducer as every component; each processor is then
handed its model's queue view. A model undeployed while requests wait ends them; a processor of a
model the log no longer knows is removed (through intake). The two facts the dispatcher appends go
out from here: `ReplicaServed` before it first calls a replica, and `ReplicaDrained` once a draining
replica has nothing of its in flight. Depends on intake.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from controlplane.core.ports import EventLog, Stored
from controlplane.core.projections import ClusterState
from controlplane.core.projections.queue import queue_view
from controlplane.service.clock import observed
from controlplane.service.follow import follow_log
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.dispatcher.intake import KNOWN_GRACE_S, Intake
from dataplane.serving.processor import Processor
from schemas.events import Event, ModelUndeployed, ReplicaDrained, ReplicaServed
from schemas.keys import display_name
from schemas.refusals import FactRefused
from schemas.status import ReplicaState

logger = structlog.get_logger("ndif.dispatcher")


class LogFollower:
    def __init__(self, *, log: EventLog, state: ClusterState, processors: dict[str, Processor], intake: Intake,
                 bg: Background, name: str) -> None:
        self.log = log
        self.state = state  # the dispatcher's fold: written only here
        self.processors = processors
        self.intake = intake
        self.bg = bg
        self.name = name
        self._drained: set[tuple[str, int, int]] = set()
        self._served: set[tuple[str, int, int]] = set()

    async def run(self) -> None:
        await follow_log(self.log, lambda: self.state.seq + 1, self.on_batch, logger=logger,
                         fold=lambda: self.state, refold=self.refold)

    async def refold(self, state: ClusterState) -> None:
        """The log went back: serve from what it holds now (the fold is shared: replaced in place)."""
        self.state.become(state)
        self._drained.clear()
        self._served.clear()
        logger.warning("dispatcher_refolded", seq=state.seq)
        self.sync_all()

    def on_batch(self, batch: list[Stored]) -> None:
        undeployed: set[str] = set()
        for seq, item in batch:
            self.state.apply(seq, item)
            if isinstance(item, ModelUndeployed):
                undeployed.add(item.model_key)
        self.sync_all(undeployed)

    def sync_all(self, undeployed: set[str] | frozenset[str] = frozenset()) -> None:
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
            known = known if known is not None else self.intake.known_tokens()
            if p.token not in known and time.monotonic() - p.born > KNOWN_GRACE_S and not p.running():
                # undeployed and forgotten (or never known): its processor and durable consumer go
                self.bg.spawn(self.intake.remove_model(p.token, reason="the model is no longer deployed"))

    def report_drained(self, model_key: str, replica_id: int) -> None:
        """A draining replica has no request left: append `ReplicaDrained` (once per drain)."""
        r = self.state.replicas.get((model_key, replica_id))
        if r is None or r.state != ReplicaState.DRAINING:
            return
        mark = (model_key, replica_id, r.since_seq)
        if mark in self._drained:
            return
        self._drained = self._current(self._drained)
        self._drained.add(mark)
        ev = observed(ReplicaDrained, actor=self.name, model_key=model_key, replica_id=replica_id, node_id=r.node_id)
        self.bg.spawn(self._append(ev, self._drained, mark))
        logger.info("replica_drained", model_key=model_key, replica_id=replica_id)

    def report_served(self, model_key: str, replica_id: int) -> None:
        """This dispatcher is about to call an Available replica: append `ReplicaServed` (once per
        state of the replica); its processor calls the replica once the fold holds it."""
        r = self.state.replicas.get((model_key, replica_id))
        if r is None or r.state != ReplicaState.AVAILABLE or self.name in r.served_by:
            return
        mark = (model_key, replica_id, r.since_seq)
        if mark in self._served:
            return
        self._served = self._current(self._served)
        self._served.add(mark)
        ev = observed(ReplicaServed, actor=self.name, model_key=model_key, replica_id=replica_id, node_id=r.node_id)
        self.bg.spawn(self._append(ev, self._served, mark))

    def _current(self, marks: set[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
        """The marks still stamped with their replica's state (no other one is met again)."""
        return {m for m in marks if (r := self.state.replicas.get(m[:2])) is not None and r.since_seq == m[2]}

    async def _append(self, ev: Event, marks: set[tuple[str, int, int]], mark: tuple[str, int, int]) -> None:
        for attempt in range(8):
            try:
                await self.log.append([ev], None)
                return
            except FactRefused as exc:  # the gate kept it out of the log: sending it again changes nothing
                logger.error("fact_refused", event_type=type(ev).__name__, error=str(exc))
                break
            except Exception as exc:  # noqa: BLE001 - NATS away for a moment: try again, then let the next event retry
                logger.warning("append_retry", event_type=type(ev).__name__, attempt=attempt, error=str(exc))
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
        marks.discard(mark)
