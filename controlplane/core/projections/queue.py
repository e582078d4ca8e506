"""The queue-side view (docs/architecture.md §4): per model, the replica set a processor serves from.

It is read off the same fold as the cluster view, not folded by a second reducer, so the
dispatcher and the controller can never disagree about which replica is ready: the "state sync
lag" of NDIF's two control planes has nothing to live in.
"""

from __future__ import annotations

import msgspec

from controlplane.core.projections.cluster import ClusterState
from schemas.status import Level, ProcessorStatus, ReplicaState

S = ReplicaState


class ModelQueueView(msgspec.Struct, frozen=True, kw_only=True):
    """What a processor needs from the log for one model."""

    model_key: str
    replica_count: int  # replicas whose desired level is HOT (ClusterState.replica_count)
    ready: tuple[int, ...]  # Available: each gets its lanes
    draining: tuple[int, ...]  # finish in-flight work, take nothing new
    starting: tuple[int, ...]  # scheduled, loading or restarting
    failed: tuple[int, ...]  # desired HOT but failed to load or died
    # Of those, the ones whose load failed: nothing restarts them but an operator (a replica that
    # died at run time is restarted or replaced by the controller).
    load_failed: tuple[int, ...] = ()
    rejected: bool = False  # the last placement for it could not be satisfied
    nodes: tuple[tuple[int, str], ...] = ()  # (replica id, node id) of each placed replica: its endpoint's node
    served_by: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (replica id, dispatchers that call it) of ready ones


def queue_view(state: ClusterState, model_key: str) -> ModelQueueView:
    rs = state.model_replicas(model_key)
    m = state.models.get(model_key)
    hot = [r for r in rs if r.desired is Level.HOT]
    return ModelQueueView(
        model_key=model_key,
        replica_count=len(hot),
        ready=tuple(r.replica_id for r in rs if r.state is S.AVAILABLE),
        draining=tuple(r.replica_id for r in rs if r.state is S.DRAINING),
        starting=tuple(r.replica_id for r in hot if r.state in (S.LOAD_REQUESTED, S.LOADING, S.RESTARTING)),
        failed=tuple(r.replica_id for r in hot if r.state in (S.FAILED, S.LOAD_FAILED)),
        load_failed=tuple(r.replica_id for r in hot if r.state is S.LOAD_FAILED),
        rejected=m is not None and m.last_rejection is not None and m.last_rejection.seq >= m.since_seq,
        nodes=tuple((r.replica_id, r.node_id) for r in rs if r.node_id),
        served_by=tuple((r.replica_id, r.served_by) for r in rs if r.state is S.AVAILABLE),
    )


def load_failed_for_good(view: ModelQueueView) -> bool:
    """Every replica the model should have failed to load, and nothing is starting or ready: no
    request for it can run until an operator restarts or deploys it again (the controller retries
    run-time failures itself, and a placement refused for room is retried by provisioning)."""
    return (view.replica_count > 0 and not view.ready and not view.starting and not view.rejected
            and len(view.load_failed) == view.replica_count)


def processor_status(view: ModelQueueView, *, in_flight: int, queued: int, provisioning: bool = False) -> ProcessorStatus:
    """The model processor's status (NDIF's processor statuses), derived from the replica view plus in-flight work."""
    if view.ready:
        return ProcessorStatus.BUSY if in_flight else ProcessorStatus.READY
    if view.starting:
        return ProcessorStatus.DEPLOYING
    if provisioning:
        return ProcessorStatus.PROVISIONING
    if view.replica_count and (view.failed or view.rejected) and not view.starting:
        return ProcessorStatus.CANCELLED
    if view.replica_count:
        return ProcessorStatus.PROVISIONING
    return ProcessorStatus.PROVISIONING if queued else ProcessorStatus.UNINITIALIZED
