"""decide(state, command, ctx) -> events: every operator command and controller policy, pure.

The controller folds the log, calls these with a `DecisionContext` (time, actor, command id, seed),
and appends what they return as one atomic decision. An `NdifError` raised here is the answer to the
command, with nothing appended. A command id already in the fold decides nothing (idempotency
beyond JetStream's dedup window).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import msgspec

from controlplane.core.context import DecisionContext
from controlplane.core.placement import (
    MIN_DEPLOY_S,
    PADDING,
    PlacementRequest,
    Plan,
    cache_target,
    gpus_refusal,
    padded,
    plan,
    scale_down_victims,
)
from controlplane.core.projections.cluster import ClusterState
from controlplane.core.projections.cluster import Registration as Registration  # decide()'s argument type, re-exported
from controlplane.core.projections.replica import ReplicaView
from controlplane.core.requirements import requirements_refusal
from schemas.commands import (
    MAX_REPLICAS_PER_MODEL,
    RAISE_REPLICA_LIMITS,
    AnyCommand,
    Autoscale,
    CommandResult,
    Deploy,
    Evict,
    OnDemand,
    Rejection,
    ReplicaOutcome,
    Restart,
    Scale,
    ScaleDown,
    Undeploy,
    fingerprint,
)
from schemas.errors import AlreadyDeployed, CommandIdConflict, InvalidCommand, NotFound, OnDemandRefused, UnknownModel
from schemas.events import (
    AutoscalePolicySet,
    ClusterDown,
    CommandDecided,
    DeploymentRequested,
    Event,
    ModelRegistered,
    ModelUndeployed,
    NodeDeclared,
    NodeLost,
    PlacementRejected,
    ReplicaEvictionRequested,
    ReplicaRestartRequested,
    ReplicaScheduled,
    RolloutUpdated,
)
from schemas.inventory import Inventory, NodeInventory, Requirements
from schemas.keys import display_name
from schemas.status import DeploymentOp, EvictionReason, Level, ReplicaState
from schemas.units import gib

S = ReplicaState
MAX_RESTARTS = 3


def decide(state: ClusterState, cmd: AnyCommand, ctx: DecisionContext, *,
           registration: Registration | None = None, min_deploy_s: float = MIN_DEPLOY_S,
           headroom: float = PADDING, max_replicas_per_model: int = MAX_REPLICAS_PER_MODEL,
           on_demand: OnDemand | None = None) -> list[Event]:
    """The events `cmd` yields on `state`. Raises InvalidCommand / NotFound / UnknownModel.

    `min_deploy_s` and `headroom` are the controller's settings (a model's own headroom, recorded
    at deploy, wins over `headroom`); the events record what was used. `on_demand`: who may have a
    model deployed by a request, and how many (the default: `OnDemand()`).

    Every decision starts with `CommandDecided` (verb, fingerprint of what was asked), also when
    it changes nothing: the command id is then in the log, so the same id later appends nothing
    whatever its first outcome, and the same id with another payload is refused
    (`CommandIdConflict`).
    """
    fp = fingerprint(cmd)
    if already_decided(state, cmd, fp):
        return []  # already decided: the first result stands
    note = ""
    body: list[Event]
    match cmd:
        case Deploy():
            _not_undeploying(state, cmd.model_key)
            if state.replica_count(cmd.model_key):
                raise AlreadyDeployed(
                    f"{display_name(cmd.model_key)} already has {state.replica_count(cmd.model_key)} replicas (desired HOT): "
                    f"use `ndif scale {display_name(cmd.model_key)} --replicas N`")
            # A deploy of a model at zero (the dispatcher's on a first request, or an operator's
            # without flags) keeps the card count and requirements the model was deployed with.
            kept = state.models.get(cmd.model_key)
            gpus = cmd.gpus if cmd.gpus is not None else (kept.gpus if kept is not None else None)
            requires = cmd.requires if cmd.requires is not None else (kept.requires if kept is not None else None)
            user = on_demand_user(state, cmd, on_demand or OnDemand())
            body = _grow(state, cmd.model_key, cmd.replicas, cmd.replicas, DeploymentOp.DEPLOY, cmd.replicas,
                         cmd.dedicated, ctx, registration, cmd.size_bytes, min_deploy_s,
                         headroom if cmd.headroom is None else cmd.headroom, gpus, requires, for_user=user,
                         evicts=not cmd.for_request)  # a request's deploy never evicts, the operator's model too
        case Scale():
            _not_undeploying(state, cmd.model_key)
            current = state.replica_count(cmd.model_key)
            target = current + cmd.replicas if cmd.scale_up else max(current, cmd.replicas)
            if target > max_replicas_per_model:
                raise InvalidCommand(
                    f"{display_name(cmd.model_key)} would have {target} replicas, above this controller's limit "
                    f"of {max_replicas_per_model} per model; to raise it: {RAISE_REPLICA_LIMITS}")
            if target == current:
                name = display_name(cmd.model_key)
                body = []
                note = (f"nothing to do: {name} already has {current} HOT replica(s); scale never scales down: "
                        f"use `ndif scale-down {name} --replicas {cmd.replicas}`" if cmd.replicas < current else
                        f"nothing to do: {name} already has {current} HOT replica(s)")
            else:
                op = DeploymentOp.SCALE_UP if cmd.scale_up else DeploymentOp.SCALE
                m = state.models.get(cmd.model_key)
                body = _grow(state, cmd.model_key, target - current, target, op, cmd.replicas, cmd.dedicated, ctx,
                             registration, None, min_deploy_s, model_headroom(state, cmd.model_key, headroom),
                             cmd.gpus if cmd.gpus is not None else (m.gpus if m is not None else None),
                             m.requires if m is not None else None)
        case ScaleDown():
            body = _scale_down(state, cmd, ctx)
            if not body:
                name = display_name(cmd.model_key)
                hot = sum(r.desired is Level.HOT for r in state.model_replicas(cmd.model_key))
                note = (f"nothing to do: {name} has {hot} replica(s) wanted HOT, not more than "
                        f"{cmd.replicas}; scale-down never scales up: use `ndif scale {name} --replicas "
                        f"{cmd.replicas}`" if hot < cmd.replicas else
                        f"nothing to do: {name} has {hot} replica(s) wanted HOT, not more than {cmd.replicas}")
        case Evict():
            body = _evict(state, cmd, ctx)
            if not body:
                note = _evict_noop(state, cmd)
        case Restart():
            body = _restart(state, cmd, ctx)
            if not body:
                states = ", ".join(f"{r.replica_id} {r.state}" for r in state.model_replicas(cmd.model_key)[:20])
                note = (f"nothing to do: no replica of {display_name(cmd.model_key)} is Available, Failed or "
                        f"LoadFailed (a restart takes those; {states or 'none'})")
        case Undeploy():
            body = _undeploy(state, cmd, ctx)
        case Autoscale():
            _not_undeploying(state, cmd.model_key)
            _known(state, cmd.model_key)
            m = state.models[cmd.model_key]
            if cmd.off and m.autoscale is None:
                note = f"nothing to do: autoscaling of {display_name(cmd.model_key)} is already off"
                body = []
            else:
                body = [ctx.event(AutoscalePolicySet, model_key=cmd.model_key, policy=None if cmd.off else cmd.policy)]
        case _:
            raise InvalidCommand(f"unknown command {type(cmd).__name__}")
    head = ctx.event(CommandDecided, model_key=getattr(cmd, "model_key", None), verb=str(cmd.__struct_config__.tag),
                     fingerprint=fp, note=note)
    return [head, *body]


def already_decided(state: ClusterState, cmd: AnyCommand, fp: str | None = None) -> bool:
    """Is this command id in the log? Raises CommandIdConflict when it was used for another command."""
    rec = state.commands.get(cmd.command_id)
    if rec is None:
        return False
    if rec.fingerprint and rec.fingerprint != (fp or fingerprint(cmd)):
        raise CommandIdConflict(
            f"command id {cmd.command_id!r} was already used for a different command "
            f"({rec.verb or 'another command'}, seq {rec.first_seq}); give this command a new --command-id")
    return True


def _not_undeploying(state: ClusterState, model_key: str) -> None:
    m = state.models.get(model_key)
    if m is not None and m.undeployed:
        left = len(state.model_replicas(model_key))
        raise InvalidCommand(f"{display_name(model_key)} is being undeployed ({left} replica(s) still unloading); "
                             "deploy it again once `ndif status` no longer lists it")


def _size(state: ClusterState, model_key: str, registration: Registration | None,
          override: int | None) -> tuple[int, Registration | None]:
    """The model's size, and the registration to record (None: already in the log)."""
    m = state.models.get(model_key)
    if m is not None and m.registration is not None:
        if override is not None and override != m.registration.size_bytes:
            # A size is part of a model's registration: silently keeping the old one would place
            # replicas for a size the operator did not ask for; silently taking the new one would
            # change what every placed replica was charged. Refused, with what to do.
            raise InvalidCommand(
                f"{display_name(model_key)} is registered at {gib(m.registration.size_bytes)}; "
                f"--size-gib ({gib(override)}) applies only when a model is registered: leave it out, "
                "or `ndif undeploy` the model and deploy it again with the new size")
        return m.registration.size_bytes, None
    if registration is None:
        raise UnknownModel(f"unknown model {display_name(model_key)}: not registered and not resolved "
                           "(give a local checkpoint dir, a repo in the HF cache, or --size-gib)")
    twin = same_checkpoint(state, model_key, registration)
    if twin is not None:
        # A second key for a registered checkpoint would be a second model (its own replicas and
        # cards) loading the same weights.
        raise InvalidCommand(f"{display_name(model_key)} is the checkpoint the model {display_name(twin)} is "
                             f"registered with: one checkpoint is one model here; use {display_name(twin)}")
    if override is not None:
        registration = msgspec.structs.replace(registration, size_bytes=override)
    return registration.size_bytes, registration


def on_demand_user(state: ClusterState, cmd: Deploy, policy: OnDemand) -> str | None:
    """The user a deploy is on demand for (None: the operator's), once its right and bounds are
    checked (OnDemandRefused). A request's deploy of a model the operator deployed before brings
    the operator's model back; of any other, it is on demand: a right, bounded, on free room only."""
    kept = state.models.get(cmd.model_key)
    if not cmd.for_request or (kept is not None and kept.registration is not None and kept.on_demand_for is None):
        return None
    user = cmd.for_user or ""
    _on_demand_allowed(state, cmd.model_key, user, policy)
    return user


def on_demand_models(state: ClusterState, user: str | None = None) -> list[str]:
    """Models deployed on demand that still want replicas HOT: `user`'s (None: everyone's)."""
    return [k for k, m in state.models.items() if m.on_demand_for is not None and not m.undeployed
            and m.target_hot > 0 and (user is None or m.on_demand_for == user)]


def _on_demand_allowed(state: ClusterState, model_key: str, user: str, policy: OnDemand) -> None:
    """Refuse (OnDemandRefused) a request's deploy its user has no right to, or that is over a limit."""
    name = display_name(model_key)
    ask = f"ask the operator to deploy {name} (`ndif deploy {name}`)"
    who = f"user {user!r}" if user else "a request"
    if policy.users is not None and user not in policy.users:
        raise OnDemandRefused(f"{who} may not have models deployed by its requests here: {ask}, or to grant it "
                              "(NDIF_ON_DEMAND_USERS)")
    mine = [k for k in on_demand_models(state, user) if k != model_key]
    if len(mine) >= policy.per_user:
        shown = ", ".join(display_name(k) for k in mine[:3])
        raise OnDemandRefused(f"{who} has {len(mine)} model(s) deployed by its requests (limit {policy.per_user} "
                              f"per user: NDIF_ON_DEMAND_PER_USER): {ask}, or to scale down one of {shown}")
    every = [k for k in on_demand_models(state) if k != model_key]
    if len(every) >= policy.total:
        raise OnDemandRefused(f"{len(every)} models are deployed by requests (limit {policy.total} for all users: "
                              f"NDIF_ON_DEMAND_TOTAL): {ask}, or to scale down one of them")


def same_checkpoint(state: ClusterState, model_key: str, registration: Registration) -> str | None:
    """Another model registered with the checkpoint `registration` resolved `model_key` to, if any."""
    for other, m in state.models.items():
        if other != model_key and m.registration is not None and m.registration.checkpoint == registration.checkpoint:
            return other
    return None


def model_headroom(state: ClusterState, model_key: str, default: float) -> float:
    """The headroom a model is charged with: its own (recorded at deploy), else the controller's default."""
    m = state.models.get(model_key)
    return m.headroom if m is not None and m.headroom is not None else default


def _grow(state: ClusterState, model_key: str, new: int, target: int, op: DeploymentOp, typed: int,
          dedicated: bool, ctx: DecisionContext, registration: Registration | None, override: int | None,
          min_deploy_s: float, headroom: float, gpus: int | None,
          requires: Requirements | None = None, *, for_user: str | None = None, evicts: bool = True) -> list[Event]:
    """`for_user`: deployed on demand for that user's request (recorded). `evicts` False: free room
    only (so is any deploy for a user)."""
    size, reg = _size(state, model_key, registration, override)
    # Refused before anything is reserved (nothing is appended): no live node meets what the model
    # requires, or none has the cards its GPU count asks for.
    why = requirements_refusal(state, requires)
    if why is None and gpus is not None:
        why = gpus_refusal(state, padded(size, headroom), gpus, requires)
    if why is not None:
        raise InvalidCommand(f"{display_name(model_key)}: {why}")
    events: list[Event] = []
    if reg is not None:
        events.append(ctx.event(ModelRegistered, model_key=model_key, checkpoint=reg.checkpoint,
                                revision=reg.revision, size_bytes=reg.size_bytes, dtype=reg.dtype))
    events.append(ctx.event(DeploymentRequested, model_key=model_key, op=op, replicas=typed, target_hot=target,
                            dedicated=dedicated, headroom=headroom, gpus=gpus,
                            requires=msgspec.UNSET if requires is None else requires,
                            for_user=msgspec.UNSET if for_user is None else for_user))
    p = plan(state, [PlacementRequest(model_key=model_key, size_bytes=size, replicas=new, dedicated=dedicated,
                             headroom=headroom, gpus=gpus, requires=requires,
                             evicts=evicts and for_user is None)],
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
        raise NotFound(f"unknown model {display_name(model_key)}: it was never deployed (or was undeployed)")
    return state.model_replicas(model_key)


def _scale_down(state: ClusterState, cmd: ScaleDown, ctx: DecisionContext) -> list[Event]:
    _known(state, cmd.model_key)
    return shrink(state, cmd.model_key, cmd.replicas, ctx)


def shrink(state: ClusterState, model_key: str, keep: int, ctx: DecisionContext, *,
           to: Level = Level.COLD) -> list[Event]:
    """At most `keep` HOT replicas: those that leave (drained first when serving) go to `to` (WARM
    where the node's CPU cache holds them, else COLD), chosen so that the ones kept stay spread over
    nodes (`scale_down_victims`: the most crowded node first, then the highest id). Nothing when
    there are no more."""
    hot = [r for r in state.model_replicas(model_key) if r.desired is Level.HOT]
    excess = scale_down_victims(hot, len(hot) - keep)
    if not excess:
        return []
    events: list[Event] = [ctx.event(DeploymentRequested, model_key=model_key, op=DeploymentOp.SCALE_DOWN,
                                     replicas=keep, target_hot=keep)]
    pending_cpu: dict[str, int] = {}
    for r in excess:
        nothing = r.state in (S.LOAD_FAILED, S.FAILED, S.LOST)
        target = cache_target(state, r, pending_cpu) if to is Level.WARM and not nothing else Level.COLD
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=EvictionReason.SCALE_DOWN, target=target,
                                drain=r.state is S.AVAILABLE))
    return events


def grow(state: ClusterState, model_key: str, target: int, ctx: DecisionContext, *,
         min_deploy_s: float = MIN_DEPLOY_S, headroom: float = PADDING) -> list[Event]:
    """At least `target` HOT replicas of a registered model, placed as `ndif scale` places them
    (its recorded headroom, cards and dedication). Nothing when it has as many already."""
    current = state.replica_count(model_key)
    if target <= current:
        return []
    m = state.models[model_key]
    return _grow(state, model_key, target - current, target, DeploymentOp.SCALE, target, m.dedicated, ctx, None,
                 None, min_deploy_s, model_headroom(state, model_key, headroom), m.gpus, m.requires,
                 evicts=m.on_demand_for is None)


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
            # A replica that failed (to load, or at run time) or was lost holds no weights to cache:
            # it goes COLD, and the reply says so (never "-> WARM" for what stays on disk).
            nothing = r.state in (S.LOAD_FAILED, S.FAILED, S.LOST)
            target = Level.COLD if cmd.cold or nothing else cache_target(state, r, pending_cpu)
        elif r.desired is Level.WARM and (cmd.cold or cmd.replica_id is not None):
            target = Level.COLD  # evicting a WARM replica, or --cold: down to disk
        else:
            continue
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=EvictionReason.ADMIN, target=target,
                                drain=r.state is S.AVAILABLE))
    return events


def _evict_noop(state: ClusterState, cmd: Evict) -> str:
    """What an evict that changed nothing says: where the replicas already are, and the next step."""
    pool = list(state.replicas.values()) if cmd.all else [
        r for r in state.model_replicas(cmd.model_key or "") if cmd.replica_id in (None, r.replica_id)]
    warm = sum(1 for r in pool if r.desired is Level.WARM)
    where = f"no replica is wanted HOT ({warm} WARM in CPU memory, {len(pool) - warm} COLD on disk)"
    hint = "; `ndif evict --cold` takes WARM replicas to COLD (disk), `ndif undeploy` forgets the model" if warm else ""
    name = "the cluster" if cmd.all else display_name(cmd.model_key or "")
    return f"nothing to do: {name}: {where}{hint}"


def _restart(state: ClusterState, cmd: Restart, ctx: DecisionContext) -> list[Event]:
    pool = _known(state, cmd.model_key)
    if cmd.replica_id is not None:
        pool = [r for r in pool if r.replica_id == cmd.replica_id]
        if not pool:
            raise NotFound(f"{display_name(cmd.model_key)} has no replica {cmd.replica_id}")
        r0 = pool[0]
        if r0.state not in (S.AVAILABLE, S.FAILED) and not (r0.state is S.LOAD_FAILED and r0.desired is Level.HOT):
            raise InvalidCommand(f"replica {cmd.replica_id} of {display_name(cmd.model_key)} is {r0.state}; "
                                 "only Available, Failed or LoadFailed replicas restart")
    out: list[Event] = []
    # Rolling (a whole model): replicas that serve now restart one at a time; the others (Failed,
    # LoadFailed) serve nothing, so they restart at once. A rollout under way is replaced.
    rolling = cmd.rolling and cmd.replica_id is None
    serving = sorted(r.replica_id for r in pool if r.state is S.AVAILABLE) if rolling else []
    for r in pool:
        if r.state is S.AVAILABLE and rolling:
            continue
        if r.state in (S.AVAILABLE, S.FAILED):
            out.append(ctx.event(ReplicaRestartRequested, model_key=r.model_key, replica_id=r.replica_id,
                                 node_id=r.node_id, attempt=r.restarts + 1))
        elif r.state is S.LOAD_FAILED and r.desired is Level.HOT:
            out.append(_reload(state, r, ctx))
    if serving:
        out += _rollout_step(state, cmd.model_key, tuple(serving), ctx)
    return out


def _rollout_step(state: ClusterState, model_key: str, todo: tuple[int, ...], ctx: DecisionContext) -> list[Event]:
    """Restart the first of `todo` that still serves; record the rest (RolloutUpdated)."""
    skipped = []
    for i, rid in enumerate(todo):
        r = state.replicas.get((model_key, rid))
        if r is None or r.state is not S.AVAILABLE or r.desired is not Level.HOT:
            skipped.append(rid)
            continue
        note = f"skipped replica(s) {', '.join(map(str, skipped))}: no longer Available" if skipped else ""
        return [ctx.event(ReplicaRestartRequested, model_key=model_key, replica_id=rid, node_id=r.node_id,
                          attempt=r.restarts + 1),
                ctx.event(RolloutUpdated, model_key=model_key, remaining=todo[i + 1:], current=rid, note=note)]
    return [ctx.event(RolloutUpdated, model_key=model_key, remaining=(), current=None,
                      note=f"ended: replica(s) {', '.join(map(str, skipped))} no longer Available")]


def decide_rollout(state: ClusterState, model_key: str, ctx: DecisionContext) -> list[Event]:
    """The next step of a model's rolling restart, once the replica restarted last is Available
    again; the rollout stops (RolloutUpdated with nothing remaining, and why) if that replica
    failed or left. Nothing while it is still restarting, or with no rollout under way."""
    m = state.models.get(model_key)
    if m is None or not m.rollout:
        return []
    cur = state.replicas.get((model_key, m.rollout_current)) if m.rollout_current is not None else None
    if cur is not None and cur.desired is Level.HOT and cur.state is not S.AVAILABLE:
        if cur.state in (S.FAILED, S.LOAD_FAILED):
            return [ctx.event(RolloutUpdated, model_key=model_key, remaining=(), current=None,
                              note=f"stopped: replica {cur.replica_id} is {cur.state} after its restart; "
                                   f"replica(s) {', '.join(map(str, m.rollout))} not restarted")]
        return []  # still coming back
    return _rollout_step(state, model_key, m.rollout, ctx)


def _reload(state: ClusterState, r: ReplicaView, ctx: DecisionContext) -> Event:
    """Restart of a replica whose load failed: it holds nothing, so it is scheduled again, same id,
    onto the cards it had (if they still have room: it is a restart, not a new placement)."""
    node = state.nodes.get(r.node_id)
    name = f"replica {r.replica_id} of {display_name(r.model_key)}"
    if node is None or not node.alive:
        raise InvalidCommand(f"{name} failed to load on {r.node_id or 'no node'}, which is gone: "
                             f"`ndif evict {display_name(r.model_key)} --replica-id {r.replica_id}` then `ndif scale`")
    totals = {g.index: g.memory_bytes for g in node.gpus}
    short = [g for g in r.gpu_indices
             if g not in totals or state.card_committed(r.node_id, g) + r.bytes_per_gpu > totals[g]]
    if short or not r.gpu_indices:
        raise InvalidCommand(f"{name} cannot load again where it was: cards {short or list(r.gpu_indices)} of "
                             f"{r.node_id} have no room for it now; make room (`ndif evict`, `ndif scale-down`) "
                             "or evict it and `ndif scale`")
    return ctx.event(ReplicaScheduled, model_key=r.model_key, replica_id=r.replica_id, node_id=r.node_id,
                     gpu_indices=r.gpu_indices, bytes_per_gpu=r.bytes_per_gpu, source=Level.COLD,
                     dedicated=r.dedicated, seed=ctx.seed)


def _undeploy(state: ClusterState, cmd: Undeploy, ctx: DecisionContext) -> list[Event]:
    """Every replica still holding or asking for anything goes COLD (drained first when serving);
    `ModelUndeployed` then lets the fold forget each one once Unloaded, and the model after the last."""
    pool = _known(state, cmd.model_key)
    events: list[Event] = []
    for r in pool:
        if r.state is S.UNLOADED or (r.state is S.UNLOAD_REQUESTED and r.desired is Level.COLD):
            continue  # gone, or already on its way to disk
        events.append(ctx.event(ReplicaEvictionRequested, model_key=r.model_key, replica_id=r.replica_id,
                                node_id=r.node_id, reason=EvictionReason.UNDEPLOY, target=Level.COLD,
                                drain=r.state in (S.AVAILABLE, S.DRAINING)))
    if not state.models[cmd.model_key].undeployed:
        events.append(ctx.event(ModelUndeployed, model_key=cmd.model_key, replicas=len(events)))
    return events


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
    return _replace_replicas(state, [r], ctx, EvictionReason.FAILURE, min_deploy_s, headroom)


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
    return events + _replace_replicas(after, lost, ctx, EvictionReason.NODE_LOST, min_deploy_s, headroom,
                                      keep_unplaced=True)


def decide_inventory(state: ClusterState, inventory: Inventory, ctx: DecisionContext) -> list[Event]:
    """Record the operator's inventory: a `NodeDeclared` for each node whose declaration changes,
    and one with no cards for a node declared before and left out now (it offers nothing). An
    inventory the log already holds decides nothing."""
    out: list[Event] = []
    for node_id in sorted(set(inventory.nodes) | set(state.declared)):
        want = inventory.nodes.get(node_id, NodeInventory())
        if state.declared.get(node_id) != want:
            out.append(ctx.event(NodeDeclared, node_id=node_id, node=want))
    return out


def decide_outage(state: ClusterState, last_heard: datetime | None, ctx: DecisionContext, grace_s: float) -> list[Event]:
    """A controller starting on this log: a `ClusterDown` when nothing of the cluster was heard for
    longer than `grace_s` before now. `last_heard`: the newest heartbeat or event as the server
    stamped them; without it, the log's last event time (a time its author wrote: never later than
    now here, so a fact dated in the future cannot hide an outage). An empty log: a first start."""
    last = last_heard if last_heard is not None else state.max_ts
    if last is None or state.seq == 0:
        return []
    last = min(last, ctx.now)
    if (ctx.now - last).total_seconds() <= grace_s:
        return []
    return [ctx.event(ClusterDown, down_from=last, up_at=ctx.now)]


def decide_unplaced(state: ClusterState, ctx: DecisionContext, *, headroom: float = PADDING,
                    min_deploy_s: float = MIN_DEPLOY_S) -> list[Event]:
    """Level-triggered placement of wanted replicas that hold no place: desired HOT, state `Lost`.

    Each model's such replicas are placed where there is free room now (no pressure evictions: a
    lost replica never pushes a running one out); every one placed ends its lost predecessor
    (evicted to COLD, reason NODE_LOST) and takes a fresh id. Nothing placed: no events (nothing
    is appended, so calling this on every change of room costs nothing in the log). Pure and
    deterministic: the same state and context give the same events; after they are applied, the
    same call on the new state places nothing more unless room appeared again. Each model is
    charged its recorded headroom (else `headroom`, the controller's) on its recorded card count;
    `min_deploy_s` (the controller's) is recorded, though no replica is evicted here.
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
        reqs.append(PlacementRequest(model_key=mk, size_bytes=m.registration.size_bytes, replicas=len(wanted[mk]),
                            dedicated=False, headroom=model_headroom(state, mk, headroom), gpus=m.gpus,
                            requires=m.requires))
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
    return events + plan_events(Plan(placed=p.placed, evictions=p.evictions, min_deploy_s=min_deploy_s), ctx)


def _replace_replicas(state: ClusterState, gone: Sequence[ReplicaView], ctx: DecisionContext,
                      reason: EvictionReason, min_deploy_s: float, headroom: float, *,
                      keep_unplaced: bool = False) -> list[Event]:
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
        m = state.models.get(mk)
        if m is not None and m.registration is not None:
            reqs.append(PlacementRequest(model_key=mk, size_bytes=m.registration.size_bytes, replicas=n,
                                dedicated=any(r.dedicated for r in gone if r.model_key == mk),
                                headroom=model_headroom(state, mk, headroom), gpus=m.gpus, requires=m.requires,
                                evicts=m.on_demand_for is None))
    p = plan(state, reqs, now_s=ctx.now.timestamp(), seed=ctx.seed, min_deploy_s=min_deploy_s) if reqs else None
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


_GROW = frozenset({DeploymentOp.DEPLOY, DeploymentOp.SCALE, DeploymentOp.SCALE_UP})


def summarize(command_id: str, events: Sequence[Event], first_seq: int, *, duplicate: bool = False) -> CommandResult:
    """The typed reply for a decision's events (also rebuilt from the log for a duplicate command).

    `ok` is false when a deploy/scale placed fewer replicas than it asked (`asked`/`placed`); the
    decision is in the log all the same.
    """
    replicas, evictions, rejections = [], [], []
    head = next((e for e in events if isinstance(e, CommandDecided)), None)
    restart = head is not None and head.verb == "restart"
    grows = any(isinstance(e, DeploymentRequested) and e.op in _GROW for e in events)
    undeployed = any(isinstance(e, ModelUndeployed) for e in events)
    for e in events:
        if isinstance(e, ReplicaScheduled):
            action = "restarted" if restart else "reused-warm" if e.source is Level.WARM else "scheduled"
            replicas.append(ReplicaOutcome(model_key=e.model_key, replica_id=e.replica_id, level=Level.HOT,
                                           node_id=e.node_id, gpu_indices=tuple(e.gpu_indices), action=action))
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
    placed = sum(1 for r in replicas if r.action != "restarted") if grows else 0
    short = sum(r.replicas for r in rejections)
    asked = placed + short if grows else 0
    parts = []
    if grows:
        parts.append(f"placed {placed} of {asked} replica(s)")
    elif replicas:
        parts.append(f"{len(replicas)} replica(s) scheduled/restarted")
    if evictions:
        parts.append(f"{len(evictions)} eviction(s)")
    if undeployed:
        parts.append("model undeployed: forgotten once every replica is unloaded")
    if rejections:
        parts.append(f"{short} replica(s) could not be placed (CANT_ACCOMMODATE)")
    rollout = next((e for e in events if isinstance(e, RolloutUpdated)), None)
    if rollout is not None and rollout.remaining:
        parts.append(f"rolling: then replica(s) {', '.join(map(str, rollout.remaining))}, one at a time, "
                     "each after the previous is Available again")
    elif rollout is not None and rollout.note:
        parts.append(rollout.note)
    policy = next((e for e in events if isinstance(e, AutoscalePolicySet)), None)
    if policy is not None:
        parts.append("autoscaling off: the replica count stays as it is" if policy.policy is None else
                     f"autoscaling on: {policy.policy.min_replicas}..{policy.policy.max_replicas} replicas, "
                     f"{policy.policy.target_queue_per_replica:g} queued per replica, idle after "
                     f"{policy.policy.idle_after_s:g} s to {policy.policy.idle_to}")
    if not parts:
        parts.append(head.note if head is not None and head.note else "nothing to do")
    ok = short == 0
    return CommandResult(
        command_id=command_id, ok=ok, first_seq=first_seq if n else 0, last_seq=first_seq + n - 1 if n else 0,
        duplicate=duplicate, replicas=tuple(replicas), evictions=tuple(evictions), rejections=tuple(rejections),
        message="; ".join(parts) + (" (duplicate command: first result)" if duplicate else ""),
        error=None if ok else "PlacementError", asked=asked, placed=placed,
    )
