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
from controlplane.placement import MIN_DEPLOY_S, Plan, Request, cache_target, plan
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
           registration: Registration | None = None, min_deploy_s: float = MIN_DEPLOY_S) -> list[Event]:
    """The events `cmd` yields on `state`. Raises InvalidCommand / NotFound / UnknownModel."""
    if cmd.command_id in state.commands:
        return []  # already decided: the first result stands
    match cmd:
        case Deploy():
            if state.replica_count(cmd.model_key):
                raise InvalidCommand(
                    f"{display_name(cmd.model_key)} already has {state.replica_count(cmd.model_key)} HOT replicas: "
                    f"use `ndif scale {display_name(cmd.model_key)} --replicas N`")
            return _grow(state, cmd.model_key, cmd.replicas, cmd.replicas, DeploymentOp.DEPLOY, cmd.replicas,
                         cmd.dedicated, ctx, registration, cmd.size_bytes, min_deploy_s)
        case Scale():
            current = state.replica_count(cmd.model_key)
            target = current + cmd.replicas if cmd.scale_up else max(current, cmd.replicas)
            if target == current:
                return []  # NDIF: never scales down; nothing to do
            op = DeploymentOp.SCALE_UP if cmd.scale_up else DeploymentOp.SCALE
            return _grow(state, cmd.model_key, target - current, target, op, cmd.replicas, cmd.dedicated, ctx,
                         registration, None, min_deploy_s)
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


def _grow(state: ClusterState, model_key: str, new: int, target: int, op: DeploymentOp, typed: int,
          dedicated: bool, ctx: DecisionContext, registration: Registration | None, override: int | None,
          min_deploy_s: float) -> list[Event]:
    size, _, reg = _size(state, model_key, registration, override)
    events: list[Event] = []
    if reg is not None:
        events.append(ctx.event(ModelRegistered, model_key=model_key, checkpoint=reg.checkpoint,
                                revision=reg.revision, size_bytes=reg.size_bytes, dtype=reg.dtype))
    events.append(ctx.event(DeploymentRequested, model_key=model_key, op=op, replicas=typed, target_hot=target,
                            dedicated=dedicated))
    p = plan(state, [Request(model_key=model_key, size_bytes=size, replicas=new, dedicated=dedicated)],
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
                             dedicated=pl.dedicated, seed=ctx.seed))
    for s in p.shortfalls:
        out.append(ctx.event(PlacementRejected, model_key=s.model_key, needed_bytes=s.needed_bytes,
                             free_bytes=s.free_bytes, replicas=s.replicas))
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
                   max_restarts: int = MAX_RESTARTS) -> list[Event]:
    """A replica failed at run time: restart it in place up to `max_restarts`, then replace it elsewhere."""
    r = state.replicas.get((model_key, replica_id))
    if r is None or r.state is not S.FAILED or r.desired is not Level.HOT:
        return []  # already handled (or evicted meanwhile)
    if r.restarts < max_restarts:
        return [ctx.event(ReplicaRestartRequested, model_key=model_key, replica_id=replica_id, node_id=r.node_id,
                          attempt=r.restarts + 1)]
    return _replace_replicas(state, [r], ctx, EvictionReason.ADMIN)


def decide_node_lost(state: ClusterState, node_id: str, ctx: DecisionContext, reason: str) -> list[Event]:
    """A node's heartbeat expired: NodeLost, its replicas gone, their HOT count placed elsewhere."""
    node = state.nodes.get(node_id)
    if node is None or not node.alive:
        return []
    lost = [r for r in state.replicas.values() if r.node_id == node_id and r.state not in (S.UNLOADED,)]
    events: list[Event] = [ctx.event(NodeLost, node_id=node_id, reason=reason)]
    after = state.copy()
    after.apply(state.seq + 1, events[0])  # place against the cluster without that node
    return events + _replace_replicas(after, lost, ctx, EvictionReason.NODE_LOST, keep_unplaced=True)


def decide_unplaced(state: ClusterState, ctx: DecisionContext) -> list[Event]:
    """Level-triggered placement of wanted replicas that hold no place: desired HOT, state `Lost`.

    Each model's such replicas are placed where there is free room now (no pressure evictions: a
    lost replica never pushes a running one out); every one placed ends its lost predecessor
    (evicted to COLD, reason NODE_LOST) and takes a fresh id. Nothing placed: no events (nothing
    is appended, so calling this on every change of room costs nothing in the log). Pure and
    deterministic: the same state and context give the same events; after they are applied, the
    same call on the new state places nothing more unless room appeared again.
    """
    wanted: dict[str, list[ReplicaView]] = {}
    for r in state.replicas.values():
        if r.desired is Level.HOT and r.state is S.LOST:
            wanted.setdefault(r.model_key, []).append(r)
    if not wanted:
        return []
    reqs = []
    for mk in sorted(wanted):
        m = state.models.get(mk)
        if m is None or m.registration is None:
            continue
        reqs.append(Request(model_key=mk, size_bytes=m.registration.size_bytes, replicas=len(wanted[mk]),
                            dedicated=False))
    p = plan(state, reqs, now_s=ctx.now.timestamp(), seed=ctx.seed, min_deploy_s=float("inf"))
    if not p.placed:
        return []
    placed: dict[str, int] = {}
    for pl in p.placed:
        placed[pl.model_key] = placed.get(pl.model_key, 0) + 1
    events: list[Event] = []
    for mk in sorted(placed):
        for r in sorted(wanted[mk], key=lambda r: r.replica_id)[: placed[mk]]:
            events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                    node_id=r.node_id, reason=EvictionReason.NODE_LOST, target=Level.COLD))
    return events + plan_events(Plan(placed=p.placed, evictions=p.evictions), ctx)


def _replace_replicas(state: ClusterState, gone: Sequence[ReplicaView], ctx: DecisionContext,
                      reason: EvictionReason, *, keep_unplaced: bool = False) -> list[Event]:
    """Replace `gone` replicas elsewhere. With `keep_unplaced` (a lost node), a HOT replica with no
    new place is not ended: it stays `Lost` and wanted (desired HOT), for `decide_unplaced` to place
    once room appears (its node rejoining, or room elsewhere)."""
    events: list[Event] = []
    want: dict[str, int] = {}
    for r in gone:
        if r.desired is Level.HOT:
            want[r.model_key] = want.get(r.model_key, 0) + 1
    placed: dict[str, int] = {}
    reqs = []
    for mk, n in want.items():
        reg = state.models[mk].registration if mk in state.models else None
        if reg is not None:
            reqs.append(Request(model_key=mk, size_bytes=reg.size_bytes, replicas=n,
                                dedicated=any(r.dedicated for r in gone if r.model_key == mk)))
    p = plan(state, reqs, now_s=ctx.now.timestamp(), seed=ctx.seed) if reqs else None
    for pl in p.placed if p is not None else ():
        placed[pl.model_key] = placed.get(pl.model_key, 0) + 1
    for r in sorted(gone, key=lambda r: (r.model_key, r.replica_id)) if keep_unplaced else gone:
        if keep_unplaced and r.desired is Level.HOT:
            if placed.get(r.model_key, 0) <= 0:
                continue  # no place for it now: it stays wanted
            placed[r.model_key] -= 1
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=reason, target=Level.COLD))
    if p is not None:
        events += plan_events(p, ctx)
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
