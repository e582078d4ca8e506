"""The node agent's decision, pure: what to do next for the replicas of one node, from the fold.

`plan_actions` reads the folded `ClusterState`, which replicas have a live process here
(`actors`), which are being acted on (`in_flight`) and what was already started (`done`, by
mark), and returns the actions to start; the agent (dataplane/node/agent.py) runs them. No I/O,
clock or randomness: the same inputs give the same plan (tests/unit/test_agent_plan.py).

    LoadRequested / Loading -> LOAD (create or reuse the process, load or from_cache), once per scheduling;
                               not while a leaving replica of this node still holds one of its cards
    Draining, nobody serving it -> DRAINED (no dispatcher calls it, or every one that does said idle:
                               nothing can be in flight, the drain is reported at once)
    Draining                -> DRAIN_TIMER (report the drain if the dispatchers have not, after a timeout)
    UnloadRequested         -> UNLOAD (to_cache when desired WARM, else kill)
    Restarting              -> RESTART
    Cached, no process      -> CHECK_WARM (the weights are gone: unloaded, unless the process is found)
    Unloaded / LoadFailed / Lost, a process -> REAP (a leftover)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Set

import msgspec

from controlplane.core.projections import ClusterState
from controlplane.core.projections.replica import ReplicaView
from schemas.status import Level, ReplicaState

S = ReplicaState
RKey = tuple[str, int]
Mark = tuple[RKey, str, object]  # (replica, what, the state stamp it was decided on): an action taken once

# States in which the replica's process should exist on its node.
LIVE = frozenset({S.LOAD_REQUESTED, S.LOADING, S.AVAILABLE, S.DRAINING, S.UNLOAD_REQUESTED, S.CACHED, S.RESTARTING,
                  S.FAILED})


class Do(enum.StrEnum):
    LOAD = "load"
    DRAIN_TIMER = "drain"
    DRAINED = "drained"
    UNLOAD = "unload"
    RESTART = "restart"
    CHECK_WARM = "check-warm"
    REAP = "reap"


class Action(msgspec.Struct, frozen=True, kw_only=True):
    """One step for one replica, decided on `replica` (the view the plan read)."""

    do: Do
    replica: ReplicaView
    mark: Mark

    @property
    def key(self) -> RKey:
        return self.replica.key


def plan_actions(state: ClusterState, node_id: str, actors: Set[RKey], in_flight: Set[RKey],
                 done: Set[Mark] = frozenset()) -> list[Action]:
    """The actions to start now on `node_id`: at most one per replica, none for a replica in flight,
    none whose mark is in `done`; in the order the replicas reached their state."""
    mine = [r for r in state.replicas.values() if r.node_id == node_id]
    leaving = [r for r in mine if r.on_gpu and r.desired is not Level.HOT]
    out: list[Action] = []
    for r in sorted(mine, key=lambda r: (r.since_seq, r.model_key, r.replica_id)):
        key = r.key
        if key in in_flight:
            continue
        step = _step(r, key in actors, leaving)
        if step is None:
            continue
        do, stamp = step
        mark: Mark = (key, do.value, stamp)
        if do is not Do.REAP and mark in done:
            continue
        out.append(Action(do=do, replica=r, mark=mark))
    return out


def _step(r: ReplicaView, has_actor: bool, leaving: list[ReplicaView]) -> tuple[Do, object] | None:
    match r.state:
        case S.LOAD_REQUESTED | S.LOADING:
            cards = set(r.gpu_indices)
            if any(o.key != r.key and cards & set(o.gpu_indices) for o in leaving):
                return None  # the leaving replica's unload comes first; its event plans again
            return Do.LOAD, r.scheduled_at
        case S.DRAINING:
            if all(d in r.drained_by for d in r.served_by):
                return Do.DRAINED, r.since_seq
            return Do.DRAIN_TIMER, r.since_seq
        case S.UNLOAD_REQUESTED:
            return Do.UNLOAD, r.since_seq
        case S.RESTARTING:
            return Do.RESTART, r.since_seq
        case S.CACHED if not has_actor:
            return Do.CHECK_WARM, r.since_seq  # WARM in the log but no process holds the weights
        case S.UNLOADED | S.LOAD_FAILED | S.LOST if has_actor:
            return Do.REAP, r.since_seq  # a leftover process (e.g. after a failed load): not wanted
    return None


def current_marks(state: ClusterState, node_id: str, done: Iterable[Mark]) -> set[Mark]:
    """The marks of `done` that can still stop an action: those stamped with their replica's current
    state on `node_id` (its `since_seq`, or its scheduling while it loads). A replica's state only
    moves on, so no other mark is ever met again; a reap is planned whatever `done` holds."""
    out: set[Mark] = set()
    for mark in done:
        key, what, stamp = mark
        r = state.replicas.get(key)
        if r is None or r.node_id != node_id or what == Do.REAP.value:
            continue
        if stamp == r.since_seq or (r.state in (S.LOAD_REQUESTED, S.LOADING) and stamp == r.scheduled_at):
            out.add(mark)
    return out


def plan_adoption(state: ClusterState, node_id: str, found: Iterable[RKey]) -> tuple[list[RKey], list[RKey]]:
    """Live processes found on this node at start: (kept, killed). Kept: the log wants the replica
    on this node in a state with a process; every other one is an orphan."""
    keep: list[RKey] = []
    kill: list[RKey] = []
    for key in found:
        r = state.replicas.get(key)
        (keep if r is not None and r.node_id == node_id and r.state in LIVE else kill).append(key)
    return keep, kill


__all__ = ["LIVE", "Action", "Do", "Mark", "current_marks", "plan_actions", "plan_adoption"]
