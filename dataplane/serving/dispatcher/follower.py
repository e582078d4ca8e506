"""Following the log: the dispatcher's fold, and each processor's replica set kept in step with it.

Every batch of events is folded with the same reducer as every component; each processor is then
handed its model's queue view. A model undeployed while requests wait ends them; a processor of a
model the log no longer knows is removed (through intake). A draining replica that went idle is
reported here, as `ReplicaDrained`, the one event the dispatcher appends. Depends on intake.
"""

from __future__ import annotations

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
from schemas.events import ModelUndeployed, ReplicaDrained
from schemas.keys import display_name
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

    async def run(self) -> None:
        await follow_log(self.log, lambda: self.state.seq + 1, self.on_batch, logger=logger,
                         fold=lambda: self.state)

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
        self._drained.add(mark)
        ev = observed(ReplicaDrained, actor=self.name, model_key=model_key, replica_id=replica_id, node_id=r.node_id)
        self.bg.spawn(self.log.append([ev], None))
        logger.info("replica_drained", model_key=model_key, replica_id=replica_id)
