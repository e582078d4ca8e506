"""decide(state, command, ctx) -> events: every operator command and controller policy, pure.

The controller folds the log, calls these with a `DecisionContext` (time, actor, command id, seed),
and appends what they return as one atomic decision. An `NdifError` raised here is the answer to the
command, with nothing appended. A command id already in the fold decides nothing (idempotency
beyond JetStream's dedup window).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from controlplane.context import DecisionContext
from controlplane.placement import (
    MIN_DEPLOY_S,
    PADDING,
    Plan,
    Request,
    cache_target,
    gpus_refusal,
    padded,
    plan,
)
from controlplane.projections.cluster import ClusterState
from controlplane.projections.replica import ReplicaView
from schemas.commands import (
    AnyCommand,
    CommandResult,
    Deploy,
    Evict,
    Rejection,
    ReplicaOutcome,
    Restart,
    Scale,
    ScaleDown,
)
from schemas.errors import InvalidCommand, NotFound, UnknownModel
from schemas.events import (
    DeploymentRequested,
    Event,
    ModelRegistered,
    NodeLost,
    PlacementRejected,
    ReplicaEvictionRequested,
    ReplicaRestartRequested,
    ReplicaScheduled,
)
from schemas.keys import display_name
from schemas.status import DeploymentOp, EvictionReason, Level, ReplicaState

S = ReplicaState
MAX_RESTARTS = 3


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """What the controller resolved offline for an unregistered model (checkpoint dir, measured size)."""

    checkpoint: str
    revision: str | None = None
    size_bytes: int
    dtype: str = "float32"


def decide(state: ClusterState, cmd: AnyCommand, ctx: DecisionContext, *,
           registration: Registration | None = None, min_deploy_s: float = MIN_DEPLOY_S,
           headroom: float = PADDING) -> list[Event]:
    """The events `cmd` yields on `state`. Raises InvalidCommand / NotFound / UnknownModel.

    `min_deploy_s` and `headroom` are the controller's settings (a model's own headroom, recorded
    at deploy, wins over `headroom`); the events record what was used.
    """
    if cmd.command_id in state.commands:
        return []  # already decided: the first result stands
    match cmd:
        case Deploy():
            if state.replica_count(cmd.model_key):
                raise InvalidCommand(
                    f"{display_name(cmd.model_key)} already has {state.replica_count(cmd.model_key)} HOT replicas: "
                    f"use `ndif scale {display_name(cmd.model_key)} --replicas N`")
            return _grow(state, cmd.model_key, cmd.replicas, cmd.replicas, DeploymentOp.DEPLOY, cmd.replicas,
                         cmd.dedicated, ctx, registration, cmd.size_bytes, min_deploy_s,
                         headroom if cmd.headroom is None else cmd.headroom, cmd.gpus)
        case Scale():
            current = state.replica_count(cmd.model_key)
            target = current + cmd.replicas if cmd.scale_up else max(current, cmd.replicas)
            if target == current:
                return []  # NDIF: never scales down; nothing to do
            op = DeploymentOp.SCALE_UP if cmd.scale_up else DeploymentOp.SCALE
            m = state.models.get(cmd.model_key)
            return _grow(state, cmd.model_key, target - current, target, op, cmd.replicas, cmd.dedicated, ctx,
                         registration, None, min_deploy_s, model_headroom(state, cmd.model_key, headroom),
                         cmd.gpus if cmd.gpus is not None else (m.gpus if m is not None else None))
        case ScaleDown():
            return _scale_down(state, cmd, ctx)
        case Evict():
            return _evict(state, cmd, ctx)
        case Restart():
            return _restart(state, cmd, ctx)
    raise InvalidCommand(f"unknown command {type(cmd).__name__}")


def _size(state: ClusterState, model_key: str, registration: Registration | None,
          override: int | None) -> tuple[int, list[Event], Registration | None]:
    m = state.models.get(model_key)
    if m is not None and m.registration is not None:
        return m.registration.size_bytes, [], None
    if registration is None:
        raise UnknownModel(f"unknown model {display_name(model_key)}: not registered and not resolved "
                           "(give a local checkpoint dir, a repo in the HF cache, or --size-bytes)")
    if override is not None:
        registration = msgspec.structs.replace(registration, size_bytes=override)
    return registration.size_bytes, [], registration


def model_headroom(state: ClusterState, model_key: str, default: float) -> float:
    """The headroom a model is charged with: its own (recorded at deploy), else the controller's default."""
    m = state.models.get(model_key)
    return m.headroom if m is not None and m.headroom is not None else default


def _grow(state: ClusterState, model_key: str, new: int, target: int, op: DeploymentOp, typed: int,
          dedicated: bool, ctx: DecisionContext, registration: Registration | None, override: int | None,
          min_deploy_s: float, headroom: float, gpus: int | None) -> list[Event]:
    size, _, reg = _size(state, model_key, registration, override)
    if gpus is not None:
        why = gpus_refusal(state, padded(size, headroom), gpus)
        if why is not None:  # refused before anything is reserved: nothing is appended
            raise InvalidCommand(f"{display_name(model_key)}: {why}")
    events: list[Event] = []
    if reg is not None:
        events.append(ctx.event(ModelRegistered, model_key=model_key, checkpoint=reg.checkpoint,
                                revision=reg.revision, size_bytes=reg.size_bytes, dtype=reg.dtype))
    events.append(ctx.event(DeploymentRequested, model_key=model_key, op=op, replicas=typed, target_hot=target,
                            dedicated=dedicated, headroom=headroom, gpus=gpus))
    p = plan(state, [Request(model_key=model_key, size_bytes=size, replicas=new, dedicated=dedicated,
                             headroom=headroom, gpus=gpus)],
             now_s=ctx.now.timestamp(), seed=ctx.seed, min_deploy_s=min_deploy_s)
    return events + plan_events(p, ctx)


def plan_events(p: Plan, ctx: DecisionContext, reason: EvictionReason = EvictionReason.PRESSURE) -> list[Event]:
    """A placement plan as events: evictions first, then schedules, then what could not be placed."""
    out: list[Event] = []
    for e in p.evictions:
        out.append(ctx.event(ReplicaEvictionRequested, model_key=e.model_key, replica_id=e.replica_id,
                             node_id=e.node_id, reason=reason, target=e.target, drain=False,
                             by_model_key=e.by_model_key, by_replica_id=e.by_replica_id))
    for pl in p.placed:
        out.append(ctx.event(ReplicaScheduled, model_key=pl.model_key, replica_id=pl.replica_id, node_id=pl.node_id,
                             gpu_indices=pl.gpu_indices, bytes_per_gpu=pl.bytes_per_gpu, source=pl.source,
                             dedicated=pl.dedicated, seed=ctx.seed, headroom=pl.headroom,
                             min_deploy_s=p.min_deploy_s))
    for s in p.shortfalls:
        out.append(ctx.event(PlacementRejected, model_key=s.model_key, needed_bytes=s.needed_bytes,
                             free_bytes=s.free_bytes, replicas=s.replicas, headroom=s.headroom,
                             min_deploy_s=p.min_deploy_s))
    return out


def _known(state: ClusterState, model_key: str) -> list[ReplicaView]:
    if model_key not in state.models:
        raise NotFound(f"unknown model {display_name(model_key)}: it was never deployed")
    return state.model_replicas(model_key)


def _scale_down(state: ClusterState, cmd: ScaleDown, ctx: DecisionContext) -> list[Event]:
    hot = [r for r in _known(state, cmd.model_key) if r.desired is Level.HOT]
    excess = sorted(hot, key=lambda r: r.replica_id, reverse=True)[: max(0, len(hot) - cmd.replicas)]
    if not excess:
        return []
    events: list[Event] = [ctx.event(DeploymentRequested, model_key=cmd.model_key, op=DeploymentOp.SCALE_DOWN,
                                     replicas=cmd.replicas, target_hot=cmd.replicas)]
    for r in excess:
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=EvictionReason.SCALE_DOWN, target=Level.COLD,
                                drain=r.state is S.AVAILABLE))
    return events


def _evict(state: ClusterState, cmd: Evict, ctx: DecisionContext) -> list[Event]:
    if cmd.all:
        pool = list(state.replicas.values())
    else:
        assert cmd.model_key is not None
        pool = _known(state, cmd.model_key)
        if cmd.replica_id is not None:
            pool = [r for r in pool if r.replica_id == cmd.replica_id]
            if not pool:
                raise NotFound(f"{display_name(cmd.model_key)} has no replica {cmd.replica_id}")
    pending_cpu: dict[str, int] = {}
    events: list[Event] = []
    for r in sorted(pool, key=lambda r: (r.model_key, r.replica_id)):
        if r.desired is Level.HOT:
            target = Level.COLD if cmd.cold else cache_target(state, r, pending_cpu)
        elif r.desired is Level.WARM and (cmd.cold or cmd.replica_id is not None):
            target = Level.COLD  # evicting a WARM replica, or --cold: down to disk
        else:
            continue
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=EvictionReason.ADMIN, target=target,
                                drain=r.state is S.AVAILABLE))
    return events


def _restart(state: ClusterState, cmd: Restart, ctx: DecisionContext) -> list[Event]:
    pool = _known(state, cmd.model_key)
    if cmd.replica_id is not None:
        pool = [r for r in pool if r.replica_id == cmd.replica_id]
        if not pool:
            raise NotFound(f"{display_name(cmd.model_key)} has no replica {cmd.replica_id}")
        if pool[0].state not in (S.AVAILABLE, S.FAILED):
            raise InvalidCommand(f"replica {cmd.replica_id} of {display_name(cmd.model_key)} is {pool[0].state}; "
                                 "only Available or Failed replicas restart")
    return [ctx.event(ReplicaRestartRequested, model_key=r.model_key, replica_id=r.replica_id, node_id=r.node_id,
                      attempt=r.restarts + 1)
            for r in pool if r.state in (S.AVAILABLE, S.FAILED)]


# ---- controller policies -------------------------------------------------------------------------


def decide_failure(state: ClusterState, model_key: str, replica_id: int, ctx: DecisionContext, *,
                   max_restarts: int = MAX_RESTARTS, min_deploy_s: float = MIN_DEPLOY_S,
                   headroom: float = PADDING) -> list[Event]:
    """A replica failed at run time: restart it in place up to `max_restarts`, then replace it elsewhere
    (placed with the controller's `min_deploy_s` and `headroom`, like a command)."""
    r = state.replicas.get((model_key, replica_id))
    if r is None or r.state is not S.FAILED or r.desired is not Level.HOT:
        return []  # already handled (or evicted meanwhile)
    if r.restarts < max_restarts:
        return [ctx.event(ReplicaRestartRequested, model_key=model_key, replica_id=replica_id, node_id=r.node_id,
                          attempt=r.restarts + 1)]
    return _replace_replicas(state, [r], ctx, EvictionReason.ADMIN, min_deploy_s, headroom)


def decide_node_lost(state: ClusterState, node_id: str, ctx: DecisionContext, reason: str, *,
                     min_deploy_s: float = MIN_DEPLOY_S, headroom: float = PADDING) -> list[Event]:
    """A node's heartbeat expired: NodeLost, its replicas gone, their HOT count placed elsewhere
    (with the controller's `min_deploy_s` and `headroom`, like a command)."""
    node = state.nodes.get(node_id)
    if node is None or not node.alive:
        return []
    lost = [r for r in state.replicas.values() if r.node_id == node_id and r.state not in (S.UNLOADED,)]
    events: list[Event] = [ctx.event(NodeLost, node_id=node_id, reason=reason)]
    after = state.copy()
    after.apply(state.seq + 1, events[0])  # place against the cluster without that node
    return events + _replace_replicas(after, lost, ctx, EvictionReason.NODE_LOST, min_deploy_s, headroom)


def _replace_replicas(state: ClusterState, gone: Sequence[ReplicaView], ctx: DecisionContext,
                      reason: EvictionReason, min_deploy_s: float, headroom: float) -> list[Event]:
    events: list[Event] = []
    want: dict[str, int] = {}
    for r in gone:
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=reason, target=Level.COLD))
        if r.desired is Level.HOT:
            want[r.model_key] = want.get(r.model_key, 0) + 1
    reqs = []
    for mk, n in want.items():
        m = state.models.get(mk)
        if m is not None and m.registration is not None:
            reqs.append(Request(model_key=mk, size_bytes=m.registration.size_bytes, replicas=n,
                                dedicated=any(r.dedicated for r in gone if r.model_key == mk),
                                headroom=model_headroom(state, mk, headroom), gpus=m.gpus))
    if reqs:
        events += plan_events(plan(state, reqs, now_s=ctx.now.timestamp(), seed=ctx.seed, min_deploy_s=min_deploy_s),
                              ctx)
    return events


# ---- replies ---------------------------------------------------------------------------------------


def summarize(command_id: str, events: Sequence[Event], first_seq: int, *, duplicate: bool = False) -> CommandResult:
    """The typed reply for a decision's events (also rebuilt from the log for a duplicate command)."""
    replicas, evictions, rejections = [], [], []
    for e in events:
        if isinstance(e, ReplicaScheduled):
            replicas.append(ReplicaOutcome(model_key=e.model_key, replica_id=e.replica_id, level=Level.HOT,
                                           node_id=e.node_id, gpu_indices=tuple(e.gpu_indices),
                                           action="reused-warm" if e.source is Level.WARM else "scheduled"))
        elif isinstance(e, ReplicaRestartRequested):
            replicas.append(ReplicaOutcome(model_key=e.model_key, replica_id=e.replica_id, level=Level.HOT,
                                           node_id=e.node_id, action="restarted"))
        elif isinstance(e, ReplicaEvictionRequested):
            evictions.append(ReplicaOutcome(model_key=e.model_key, replica_id=e.replica_id, level=e.target,
                                            node_id=e.node_id, action=f"evicted ({e.reason})"))
        elif isinstance(e, PlacementRejected):
            rejections.append(Rejection(model_key=e.model_key, replicas=e.replicas, needed_bytes=e.needed_bytes,
                                        free_bytes=e.free_bytes, reason=e.reason))
    n = len(events)
    parts = []
    if replicas:
        parts.append(f"{len(replicas)} replica(s) scheduled/restarted")
    if evictions:
        parts.append(f"{len(evictions)} eviction(s)")
    if rejections:
        parts.append(f"{sum(r.replicas for r in rejections)} replica(s) could not be placed (CANT_ACCOMMODATE)")
    return CommandResult(
        command_id=command_id, ok=True, first_seq=first_seq if n else 0, last_seq=first_seq + n - 1 if n else 0,
        duplicate=duplicate, replicas=tuple(replicas), evictions=tuple(evictions), rejections=tuple(rejections),
        message=("; ".join(parts) or "nothing to do") + (" (duplicate command: first result)" if duplicate else ""),
    )
