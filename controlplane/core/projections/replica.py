"""The replica state machine of docs/architecture.md §4, as one pure function.

`step(replica, event)` returns the next replica view and, when the pair (state, event) is not in the
table, an anomaly text. It never raises: races (an agent's `ReplicaLoaded` landing after
`ReplicaEvictionRequested`) are normal and have rules; what has no rule leaves the replica as it is
(or, for observed facts that cannot be undone, follows reality) and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import msgspec

from schemas.events import (
    ReplicaCached,
    ReplicaDrained,
    ReplicaEvent,
    ReplicaEvictionRequested,
    ReplicaFailed,
    ReplicaLoaded,
    ReplicaLoadFailed,
    ReplicaLoading,
    ReplicaRestarted,
    ReplicaRestartRequested,
    ReplicaScheduled,
    ReplicaServed,
    ReplicaUnloaded,
)
from schemas.status import DrainReason, Level, ReplicaState

S = ReplicaState

# States whose actor still occupies its GPUs. `on_gpu` on the view is what memory follows; this set
# is what `ReplicaScheduled` may not land on (double booking).
ACTIVE = frozenset({S.LOAD_REQUESTED, S.LOADING, S.AVAILABLE, S.DRAINING, S.UNLOAD_REQUESTED, S.RESTARTING, S.FAILED})
# States from which a replica may be (re)scheduled.
SCHEDULABLE = frozenset({S.CACHED, S.UNLOADED, S.LOAD_FAILED, S.LOST})
SERVING = frozenset({S.AVAILABLE})


class ReplicaView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One replica: desired level (controller) and observed state (agents), and what it holds."""

    model_key: str
    replica_id: int
    desired: Level
    state: ReplicaState
    node_id: str = ""
    gpu_indices: tuple[int, ...] = ()
    bytes_per_gpu: int = 0
    on_gpu: bool = False  # bytes_per_gpu reserved on each of gpu_indices of node_id
    cpu_bytes: int = 0  # held in node_id's CPU cache (WARM)
    dedicated: bool = False
    scheduled_at: datetime | None = None
    loaded_at: datetime | None = None
    load_seconds: float | None = None
    restarts: int = 0
    error: str | None = None
    since_seq: int = 0  # seq of the event that set `state`
    cause: str | None = None  # command_id of the last desired change
    # The dispatchers that call it (`ReplicaServed`, since its scheduling) and those of them that
    # said it is idle in its current drain: a drain completes when the first holds no other name.
    served_by: tuple[str, ...] = ()
    drained_by: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, int]:
        return (self.model_key, self.replica_id)

    @property
    def level(self) -> Level:
        """Observed level: where the weights are now. A CPU copy still held means the weights are
        there (a load from WARM that has not completed, or was interrupted), whatever was asked.
        A replica whose process failed (`error` set until it is loaded or restarted again) holds
        its cards' reservation, not its weights: COLD while its restart or unload is under way."""
        if self.cpu_bytes:
            return Level.WARM
        if self.on_gpu and self.error is None and self.state in (S.AVAILABLE, S.DRAINING, S.RESTARTING,
                                                                  S.UNLOAD_REQUESTED):
            return Level.HOT
        return Level.COLD


_replace = msgspec.structs.replace


def _moved(r: ReplicaView, state: ReplicaState, seq: int, **changes: object) -> ReplicaView:
    return _replace(r, state=state, since_seq=seq, **changes)


def step(r: ReplicaView | None, ev: ReplicaEvent, seq: int) -> tuple[ReplicaView | None, str | None]:
    """Apply one replica event. Returns (next view, anomaly text or None). Pure and total."""
    if r is None:
        if isinstance(ev, ReplicaScheduled):
            fresh = ReplicaView(model_key=ev.model_key, replica_id=ev.replica_id, desired=Level.HOT, state=S.UNLOADED)
            return _schedule(fresh, ev, seq), None
        return None, f"{type(ev).__name__} for a replica that was never scheduled"
    if ev.node_id and r.node_id and ev.node_id != r.node_id and not isinstance(ev, ReplicaScheduled):
        return r, f"{type(ev).__name__} from node {ev.node_id!r}, but the replica is on {r.node_id!r}"
    rule = _RULES.get(type(ev))
    if rule is None:
        return r, f"no rule for {type(ev).__name__}"
    return rule(r, ev, seq, r.state)


# One rule per event type: (replica, event, seq, current state) -> (next, anomaly). A table keyed by
# type rather than one `match`: the fold runs this for every stored event, and a dict lookup beats
# walking a dozen class patterns.
Rule = Callable[[ReplicaView, Any, int, ReplicaState], tuple[ReplicaView, str | None]]


def _on_scheduled(r: ReplicaView, ev: ReplicaScheduled, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st in SCHEDULABLE:
        if ev.source is Level.WARM and st is not S.CACHED:
            return _schedule(r, ev, seq), f"scheduled from WARM but the replica is {st}"
        return _schedule(r, ev, seq), None
    return r, f"ReplicaScheduled while {st}: the replica already holds a placement"


def _on_loading(r: ReplicaView, ev: ReplicaLoading, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st is S.LOAD_REQUESTED:
        return _moved(r, S.LOADING, seq), None
    if st in (S.LOADING, S.AVAILABLE, S.UNLOAD_REQUESTED, S.DRAINING):
        return r, None  # late or duplicate progress report; the later state stands
    return r, f"ReplicaLoading while {st}"


def _on_loaded(r: ReplicaView, ev: ReplicaLoaded, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st is S.LOAD_REQUESTED or st is S.LOADING:
        return _moved(r, S.AVAILABLE, seq, loaded_at=ev.ts, load_seconds=ev.load_seconds, error=None,
                      cpu_bytes=0), None
    if st in (S.AVAILABLE, S.UNLOAD_REQUESTED, S.DRAINING):
        return r, None  # duplicate, or the load finished after eviction was asked: the unload stands
    return r, f"ReplicaLoaded while {st}"


def _on_load_failed(r: ReplicaView, ev: ReplicaLoadFailed, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st in (S.LOAD_REQUESTED, S.LOADING, S.RESTARTING):
        return _moved(r, S.LOAD_FAILED, seq, on_gpu=False, cpu_bytes=0, error=ev.error), None
    if st is S.UNLOAD_REQUESTED:  # eviction raced a failing load: nothing left to unload
        return _moved(r, S.UNLOADED, seq, on_gpu=False, cpu_bytes=0, error=ev.error), None
    if st is S.LOAD_FAILED:
        return r, None
    return r, f"ReplicaLoadFailed while {st}"


def _on_eviction(r: ReplicaView, ev: ReplicaEvictionRequested, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    r = _replace(r, desired=ev.target, cause=ev.command_id)
    if st is S.AVAILABLE:
        return _moved(r, S.DRAINING if ev.drain else S.UNLOAD_REQUESTED, seq, drained_by=()), None
    if st is S.DRAINING:
        return (r, None) if ev.drain else (_moved(r, S.UNLOAD_REQUESTED, seq), None)
    if st in (S.LOAD_REQUESTED, S.LOADING, S.RESTARTING, S.FAILED, S.LOAD_FAILED):
        return _moved(r, S.UNLOAD_REQUESTED, seq), None
    if st is S.CACHED:
        return (_moved(r, S.UNLOAD_REQUESTED, seq), None) if ev.target is Level.COLD else (r, None)
    if st is S.LOST:  # no agent left to answer: the replica is simply gone
        return _moved(r, S.UNLOADED, seq, on_gpu=False, cpu_bytes=0), None
    return r, None  # UnloadRequested / Unloaded: already on its way down


def _on_drained(r: ReplicaView, ev: ReplicaDrained, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st is S.DRAINING:
        if ev.reason is DrainReason.TIMEOUT:
            return _moved(r, S.UNLOAD_REQUESTED, seq, drained_by=()), None
        drained = r.drained_by
        if ev.reason is DrainReason.IDLE and ev.actor not in drained:
            drained = (*drained, ev.actor)
        if all(d in drained for d in r.served_by):  # nobody who calls it has anything left on it
            return _moved(r, S.UNLOAD_REQUESTED, seq, drained_by=()), None  # the drain is over
        return _replace(r, drained_by=drained), None
    if st in (S.UNLOAD_REQUESTED, S.CACHED, S.UNLOADED):
        return r, None  # drain escalated or timed out before the dispatcher said so
    return r, f"ReplicaDrained while {st}"


def _on_served(r: ReplicaView, ev: ReplicaServed, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    # Only an Available replica gains a caller: a dispatcher whose claim lands later sees the
    # replica's state at its claim and calls it only if it is Available there.
    if st is S.AVAILABLE and ev.actor not in r.served_by:
        return _replace(r, served_by=(*r.served_by, ev.actor)), None
    return r, None


def _on_cached(r: ReplicaView, ev: ReplicaCached, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st is S.CACHED:
        return r, None
    cached = _moved(r, S.CACHED, seq, on_gpu=False, cpu_bytes=ev.cpu_bytes)
    # An observed fact: the weights are on CPU now, whatever was asked.
    return cached, None if st is S.UNLOAD_REQUESTED else f"ReplicaCached while {st}"


def _retired(r: ReplicaView) -> Level:
    """A replica unloaded while wanted WARM has no CPU copy to go back to: it is wanted COLD from
    then on (retired, as an evict to COLD leaves it), not left wanting a level nothing reaches."""
    return Level.COLD if r.desired is Level.WARM else r.desired


def _on_unloaded(r: ReplicaView, ev: ReplicaUnloaded, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st is S.UNLOADED:
        return (_replace(r, desired=_retired(r)), None) if ev.cache_lost else (r, None)
    gone = _moved(r, S.UNLOADED, seq, on_gpu=False, cpu_bytes=0, desired=_retired(r))
    if st in (S.UNLOAD_REQUESTED, S.CACHED, S.FAILED, S.LOAD_FAILED, S.LOST):
        return gone, None
    return gone, f"ReplicaUnloaded while {st} (not requested)"


def _on_restart_requested(r: ReplicaView, ev: ReplicaRestartRequested, seq: int,
                          st: ReplicaState) -> tuple[ReplicaView, str | None]:
    r = _replace(r, desired=Level.HOT, cause=ev.command_id)
    if st is S.AVAILABLE or st is S.FAILED:
        return _moved(r, S.RESTARTING, seq, restarts=r.restarts + 1), None
    if st is S.RESTARTING:
        return r, None
    return r, f"ReplicaRestartRequested while {st}"


def _on_restarted(r: ReplicaView, ev: ReplicaRestarted, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st is S.RESTARTING:
        return _moved(r, S.AVAILABLE, seq, loaded_at=ev.ts, error=None), None
    if st in (S.AVAILABLE, S.UNLOAD_REQUESTED, S.DRAINING):
        return r, None  # duplicate, or the restart finished after eviction was asked: the unload stands
    return r, f"ReplicaRestarted while {st}"


def _on_failed(r: ReplicaView, ev: ReplicaFailed, seq: int, st: ReplicaState) -> tuple[ReplicaView, str | None]:
    if st in (S.AVAILABLE, S.DRAINING, S.RESTARTING, S.LOADING, S.LOAD_REQUESTED):
        # GPU memory stays reserved: the restart policy brings it back on the same cards. A CPU copy
        # (a load from WARM under way) lived in the process that died: gone with it.
        return _moved(r, S.FAILED, seq, error=ev.error, cpu_bytes=0), None
    if st is S.UNLOAD_REQUESTED or st is S.CACHED:  # died on its way down: nothing survives
        return _moved(r, S.UNLOADED, seq, on_gpu=False, cpu_bytes=0, error=ev.error, desired=_retired(r)), None
    if st is S.FAILED:
        return r, None
    return r, f"ReplicaFailed while {st}"


_RULES: dict[type, Rule] = {
    ReplicaScheduled: _on_scheduled,
    ReplicaLoading: _on_loading,
    ReplicaLoaded: _on_loaded,
    ReplicaLoadFailed: _on_load_failed,
    ReplicaEvictionRequested: _on_eviction,
    ReplicaDrained: _on_drained,
    ReplicaServed: _on_served,
    ReplicaCached: _on_cached,
    ReplicaUnloaded: _on_unloaded,
    ReplicaRestartRequested: _on_restart_requested,
    ReplicaRestarted: _on_restarted,
    ReplicaFailed: _on_failed,
}


def _schedule(r: ReplicaView, ev: ReplicaScheduled, seq: int) -> ReplicaView:
    return _replace(
        r,
        desired=Level.HOT,
        state=S.LOAD_REQUESTED,
        node_id=ev.node_id,
        gpu_indices=tuple(ev.gpu_indices),
        bytes_per_gpu=ev.bytes_per_gpu,
        on_gpu=True,
        # From WARM the CPU copy stays where it is until the load completes (the weights are in the
        # host's cache until then: the replica reads WARM and the cache counts them); from COLD a
        # stale CPU copy elsewhere is dropped.
        cpu_bytes=r.cpu_bytes if ev.source is Level.WARM and r.node_id == ev.node_id else 0,
        dedicated=ev.dedicated,
        scheduled_at=ev.ts,
        loaded_at=None,
        load_seconds=None,
        error=None,
        since_seq=seq,
        cause=ev.command_id,
        served_by=(),
        drained_by=(),
    )

# The rules a known replica's observed/desired events (all but scheduling) go through.
OBSERVED_RULES: dict[type, Rule] = {t: r for t, r in _RULES.items() if t is not ReplicaScheduled}
