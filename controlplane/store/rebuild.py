"""Where every fold of the log starts: the newest snapshot that matches the log, then the tail.

The controller, the agents, the dispatcher and the dashboard (through the follow loop's `catch_up`,
controlplane/service/follow.py) and `ndif status` / `ndif replay` (controlplane/store/admin.py) all
rebuild here, so each starts in the time of one snapshot plus a short tail, whatever the history's
length. A snapshot is used only if its schema is this version's, its bytes are whole, and the log
holds, at the sequence it covers, the event it names; any other is ignored with a log line and the
next older one is tried (MAX_TRIES in all), then the start of the log: a snapshot can make a fold
faster, never different.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import NamedTuple

import structlog

from controlplane.core.ports import EventLog, SnapshotStore
from controlplane.core.projections import ClusterState, check_strict
from controlplane.core.projections.cluster import SNAPSHOT_SCHEMA
from controlplane.core.projections.snapshot import KIND, SnapshotHeader, SnapshotName, decode_stored, micros, parse_name
from controlplane.store.collector import collector_paused
from schemas.events import Event

logger = structlog.get_logger("ndif.snapshots")

MAX_TRIES = 3  # snapshots tried, newest first, before folding from the start


class Start(NamedTuple):
    """Where a fold starts: the state, and the snapshot it was loaded from (None: the log's start)."""

    state: ClusterState
    name: str | None


def store_of(log: EventLog) -> SnapshotStore | None:
    """The log's snapshot store, when it has one (both logs here do)."""
    return log if isinstance(log, SnapshotStore) else None


def candidates(names: list[str], *, until_seq: int | None = None, until_time: datetime | None = None) -> list[SnapshotName]:
    """This version's cluster snapshots that cover no more than `until_seq` / events up to `until_time`, newest first."""
    t = micros(until_time) if until_time is not None else None
    out = []
    for name in names:
        n = parse_name(name)
        if n is None or n.kind != KIND or n.schema != SNAPSHOT_SCHEMA:
            continue
        if until_seq is not None and n.seq > until_seq:
            continue
        if t is not None and n.max_ts_us is not None and n.max_ts_us > t:
            continue
        out.append(n)
    out.sort(key=lambda n: n.seq, reverse=True)
    return out


async def newest_snapshot(log: EventLog, *, until_seq: int | None = None, until_time: datetime | None = None,
                          last_seq: int | None = None, loaded: dict[str, ClusterState] | None = None,
                          refused: set[str] | None = None, after_seq: int = -1) -> Start:
    """The newest usable snapshot at or before `until_seq` / `until_time`, loaded; else an empty state.

    For a caller that asks again and again (the dashboard): `loaded` holds the snapshots it loaded
    and checked before, by name (the state returned is a copy), and gets the one loaded now;
    `refused` holds the names found unusable before (passed over without a word) and gets the ones
    found now. `after_seq`: only snapshots past it are of use (the caller holds a state there)."""
    store = store_of(log)
    if store is None:
        return Start(ClusterState(), None)
    try:
        names = await store.snapshot_names()
    except Exception as exc:  # noqa: BLE001 - no bucket, no right to read it, a timeout: fold from the start
        logger.warning("snapshots_unreadable", error=str(exc) or type(exc).__name__)
        return Start(ClusterState(), None)
    last = last_seq if last_seq is not None else await log.last_seq()
    found = candidates(names, until_seq=last if until_seq is None else min(until_seq, last), until_time=until_time)
    said = refused if refused is not None else set()
    _note_ignored(names, found[0].seq if found else 0, until_seq, last, said)
    found = [n for n in found if n.seq > after_seq and n.name not in said]
    for n in found[:MAX_TRIES]:
        if loaded is not None and n.name in loaded:
            return Start(loaded[n.name].copy(), n.name)
        try:
            data = await store.load_snapshot(n.name)
        except Exception as exc:  # noqa: BLE001 - unreadable (corrupt chunks, a timeout): the next one
            _refuse(said, n.name, f"unreadable: {str(exc) or type(exc).__name__}", lasting=False)
            continue
        if data is None:
            _refuse(said, n.name, "deleted meanwhile", lasting=False)
            continue
        with collector_paused():
            got = decode_stored(data)
        if isinstance(got, str):
            _refuse(said, n.name, got)
            continue
        header, state = got
        if header.seq != n.seq or (None if header.max_ts is None else micros(header.max_ts)) != n.max_ts_us:
            _refuse(said, n.name, "its name and its header disagree (seq or time)")
            continue
        problem = await mismatch(log, header, last)
        if problem is not None:
            _refuse(said, n.name, problem)
            continue
        if loaded is not None:
            with collector_paused():
                loaded[n.name] = state.copy()
        return Start(state, n.name)
    return Start(ClusterState(), None)


def _refuse(said: set[str], name: str, reason: str, *, lasting: bool = True) -> None:
    """Log why a snapshot is not used; one whose bytes or log make it unusable is not tried again
    (a read that failed may work next time)."""
    if lasting:
        said.add(name)
    logger.warning("snapshot_ignored", name=name, reason=reason)


def _note_ignored(names: list[str], used_seq: int, until_seq: int | None, last_seq: int, said: set[str]) -> None:
    """Say (for the newest of each kind, once per caller) which snapshots were passed over unread:
    those past the log's end, and newer ones of another schema."""
    ours = [n for n in map(parse_name, names) if n is not None and n.kind == KIND and n.name not in said]
    past = [n for n in ours if n.seq > last_seq]
    if past:
        top = max(past, key=lambda n: n.seq)
        said.update(n.name for n in past)
        logger.warning("snapshot_ignored", name=top.name, others=len(past) - 1,
                       reason=f"it covers seq {top.seq}, past the log's end (seq {last_seq}): a snapshot of another log")
    limit = last_seq if until_seq is None else min(until_seq, last_seq)
    newer = [n for n in ours if n.schema != SNAPSHOT_SCHEMA and used_seq < n.seq <= limit]
    if newer:
        top = max(newer, key=lambda n: n.seq)
        said.update(n.name for n in newer)
        logger.warning("snapshot_ignored", name=top.name, others=len(newer) - 1,
                       reason=f"schema {top.schema}; this version reads schema {SNAPSHOT_SCHEMA}")


async def mismatch(log: EventLog, header: SnapshotHeader, last_seq: int) -> str | None:
    """Why a snapshot does not belong to this log (None: it does): past its end, or another event at its seq."""
    if header.seq > last_seq:
        return f"it covers seq {header.seq}, past the log's end (seq {last_seq}): a snapshot of another log"
    if header.seq == 0:
        return None
    async for seq, item in log.read(header.seq, stop_seq=header.seq):
        found = item.event_id if isinstance(item, Event) else ""
        if seq == header.seq and found == header.event_id:
            return None
        return (f"the log's event at seq {header.seq} is {found or 'unreadable'!r}, the snapshot names "
                f"{header.event_id or 'unreadable'!r}: a snapshot of another log")
    return f"the log has no event at seq {header.seq}"


async def fold_tail(log: EventLog, state: ClusterState, *, stop_seq: int,
                    until_time: datetime | None = None) -> ClusterState:
    """Fold the stored events after `state.seq` up to `stop_seq` (and, with `until_time`, up to the
    first event later than it, as `replay --until TIME` does) into `state`."""
    if stop_seq <= state.seq:
        return state
    apply = state.apply
    async for batch in log.read_batches(state.seq + 1, stop_seq=stop_seq):
        if until_time is None:
            for seq, item in batch:
                apply(seq, item)
            continue
        for seq, item in batch:
            if isinstance(item, Event) and item.ts > until_time:
                return state
            apply(seq, item)
    return state


async def rebuild(log: EventLog, *, until_seq: int | None = None, until_time: datetime | None = None,
                  strict: bool = False, snapshots: bool = True) -> ClusterState:
    """The fold of the log as it is now, or as it was at `until_seq` / `until_time`: the newest usable
    snapshot at or before that point, then the events after it. `strict`: raise ReplayAnomalyError
    if the history up to there holds anomalies or unreadable events. `snapshots=False`: from seq 1."""
    t0 = time.perf_counter()
    last = await log.last_seq()
    stop = last if until_seq is None else min(until_seq, last)
    start = (await newest_snapshot(log, until_seq=stop, until_time=until_time, last_seq=last) if snapshots
             else Start(ClusterState(), None))
    from_seq = start.state.seq
    state = await fold_tail(log, start.state, stop_seq=stop, until_time=until_time)
    logger.info("fold_rebuilt", snapshot=start.name, snapshot_seq=from_seq, tail=state.seq - from_seq, seq=state.seq,
                seconds=round(time.perf_counter() - t0, 3))
    if strict:
        check_strict(state)
    return state
