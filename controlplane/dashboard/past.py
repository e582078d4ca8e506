"""The dashboard's reach into the past: states at any position, and events older than what it keeps.

A past position is the newest snapshot at or before it (controlplane/store/rebuild.py picks and
checks it against the log) plus the events after it, read from memory where the model keeps them
and from the log before that: one snapshot plus at most the writer's interval of events, however
long the history. Older events pages and histories read the log backwards, a bounded stretch per
request, and say where to continue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from controlplane.core.ports import EventLog, Stored
from controlplane.core.projections import ClusterState
from controlplane.dashboard.model import (
    MAX_EVENTS_PAGE,
    BadQuery,
    DashboardModel,
    Filter,
    UnknownEntity,
    event_row,
    history_row,
    with_cards,
)
from controlplane.store.history import steps_of
from controlplane.store.rebuild import newest_snapshot
from schemas.events import Event
from schemas.keys import display_name

MAX_PAST_CACHE = 8  # past states asked recently, kept whole (scrubbing back and forth)
MAX_SNAPSHOTS_CACHE = 4  # snapshots loaded recently, kept decoded
MAX_SCAN = 20_000  # events read from the log for one events page before it answers with where to go on
HISTORY_SPAN = 20_000  # events one history page covers (the newest first; `before` pages back)
_READ = 1000


class Past:
    """Past states and older events of `log`, for a dashboard whose live fold is `model`."""

    def __init__(self, log: EventLog, model: DashboardModel) -> None:
        self.log = log
        self.model = model
        self._states: dict[int, ClusterState] = {}
        self._snapshots: dict[str, ClusterState] = {}
        self._refused: set[str] = set()  # snapshots found unusable (said once, not tried again)

    # ---- states ------------------------------------------------------------------------------

    async def at_seq(self, seq: int) -> ClusterState:
        """The cluster exactly as it was after `seq` (the live state itself at the last seq). Shared:
        copy it before changing it."""
        m = self.model
        if seq >= m.seq:
            return m.live
        if seq < 0:
            raise BadQuery("seq must be >= 0")
        got = self._states.get(seq)
        if got is None:
            got = await self._fold(await self._start(until_seq=seq), seq)
            self._remember(seq, got)
        return got

    def _nearest(self, seq: int) -> ClusterState | None:
        """The cached past state closest below `seq` (scrubbing forward folds on from it)."""
        below = [s for s in self._states if s <= seq]
        return self._states[max(below)] if below else None

    async def at(self, at: int | datetime) -> tuple[int, ClusterState]:
        """The sequence and state of a position as `DashboardModel.parse_until` gives it."""
        if isinstance(at, int):
            return at, await self.at_seq(at)
        return await self.at_time(at)

    async def at_time(self, t: datetime) -> tuple[int, ClusterState]:
        """The last sequence at or before `t` and the state there, as `ndif replay --until TIME`."""
        seq = self.model.seq_at_time(t)
        if seq is not None:
            return seq, await self.at_seq(seq)
        # Older than memory: the newest snapshot whose events are all at or before `t`, then on
        # until the first later event (before the first kept item, as memory said).
        state = await self._start(until_time=t)
        stop = self.model.first_kept - 1
        async for batch in self._stored(state.seq + 1, stop):
            for s, item in batch:
                if isinstance(item, Event) and item.ts > t:
                    self._remember(state.seq, state)
                    return state.seq, state
                state.apply(s, item)
        self._remember(state.seq, state)
        return state.seq, state

    async def _start(self, *, until_seq: int | None = None, until_time: datetime | None = None) -> ClusterState:
        """A fresh state to fold on from: a copy of the newest usable snapshot at or before the point
        (a loaded one is reused), or of a past state asked before when that is closer."""
        near = self._nearest(until_seq) if until_seq is not None else None
        start = await newest_snapshot(self.log, until_seq=until_seq, until_time=until_time, last_seq=self.model.seq,
                                      loaded=self._snapshots, refused=self._refused,
                                      after_seq=near.seq if near is not None else -1)
        if start.name is not None and len(self._snapshots) > MAX_SNAPSHOTS_CACHE:
            self._snapshots.pop(next(iter(self._snapshots)))
        if start.name is None and near is not None:
            return near.copy()
        return start.state

    async def _fold(self, state: ClusterState, seq: int) -> ClusterState:
        async for batch in self._stored(state.seq + 1, seq):
            for s, item in batch:
                state.apply(s, item)
        return state

    def _remember(self, seq: int, state: ClusterState) -> None:
        if len(self._states) >= MAX_PAST_CACHE:
            self._states.pop(next(iter(self._states)))
        self._states[seq] = state

    async def _stored(self, lo: int, hi: int) -> AsyncIterator[list[Stored]]:
        """Stored items lo..hi: from the log before what memory keeps, from memory after."""
        kept = self.model.first_kept
        if lo < kept and lo <= hi:
            async for batch in self.log.read_batches(lo, stop_seq=min(hi, kept - 1)):
                yield batch
        if hi >= kept:
            yield self.model.kept(max(lo, kept), hi)

    # ---- older events ------------------------------------------------------------------------

    async def events(self, *, model: str | None = None, replica_id: int | None = None, type_: str | None = None,
                     actor: str | None = None, before: int | None = None,
                     limit: int = 100) -> tuple[list[dict[str, Any]], int | None]:
        """Newest first, filtered; returns (rows, the `before` of the next page or None when there is
        none). A page holds fewer than `limit` rows with a `before` when MAX_SCAN log events were read
        without filling it: ask again from there."""
        if not 1 <= limit <= MAX_EVENTS_PAGE:
            raise BadQuery(f"limit must be 1..{MAX_EVENTS_PAGE}")
        m = self.model
        match = Filter(m.resolve_model(model) if model else None, replica_id, type_, actor)
        below = min(before if before is not None else m.seq + 1, m.seq + 1)
        rows = m.events_kept(match, below=below, limit=limit + 1)
        hi = min(below, m.first_kept) - 1
        scanned = 0
        while len(rows) <= limit and hi >= 1 and scanned < MAX_SCAN:
            lo = max(1, hi - _READ + 1)
            chunk = [p async for p in self.log.read(lo, stop_seq=hi)]
            for seq, item in reversed(chunk):
                if match(item):
                    rows.append(event_row(seq, item))
                    if len(rows) > limit:
                        break
            scanned += hi - lo + 1
            hi = lo - 1
        if len(rows) > limit:
            return rows[:limit], rows[limit - 1]["seq"]
        return rows, (hi + 1 if hi >= 1 else None)

    async def history(self, model: str, replica_id: int | None, before: int | None = None) -> dict[str, Any]:
        """`ndif history`'s data for the HISTORY_SPAN events before `before` (default: the end):
        every step of a model (or one replica) with its cause and the state it left, oldest first;
        `next_before` pages further back (None: this page reaches the log's start)."""
        m = self.model
        mk = m.resolve_model(model)
        hi = min(before - 1 if before is not None else m.seq, m.seq)
        lo = max(1, hi - HISTORY_SPAN + 1)
        if lo >= m.first_kept or hi < 1:
            steps = m.history_kept(mk, replica_id, lo, hi)
        else:
            steps = await self._history_folded(mk, replica_id, lo, hi)
        if replica_id is not None and not steps and lo == 1 and (mk, replica_id) not in m.live.replicas:
            raise UnknownEntity(f"model {model[:200]!r} has no replica {replica_id}")
        return {"model_key": mk, "name": display_name(mk), "replica_id": replica_id, "steps": with_cards(steps),
                "next_before": lo if lo > 1 else None}

    async def _history_folded(self, mk: str, replica_id: int | None, lo: int, hi: int) -> list[dict[str, Any]]:
        """The steps lo..hi, each with the state it left, folded from the snapshot before `lo`."""
        state = (await self.at_seq(lo - 1)).copy()
        steps: list[dict[str, Any]] = []
        async for batch in self._stored(lo, hi):
            steps.extend(history_row(s.seq, s.item, s.row) for s in steps_of(state, batch, mk, replica_id))
        return steps
