"""One model's (or one replica's) history: its newest events and the state each left, bounded by what is shown.

`ndif history` and `ndif status MODEL` (controlplane/ops/cli.py) read here, and the dashboard's
history pages (controlplane/dashboard/past.py) fold with `steps_of`, so the three show the same rows.
The events are read by subject (the model's token is in every subject it is stored on,
schemas/subjects.py), newest window first, so a read costs the model's events near the end of the
log, not the log. The state each left is the fold's: from the newest usable snapshot at or before
the first event shown (controlplane/store/rebuild.py), then the log's events up to each one shown,
and where a later snapshot lies between two shown events more than JUMP_EVENTS apart, from that
snapshot instead of folding through. The work is one snapshot plus at most one snapshot interval of
events for each stretch of shown events, whatever the history's length; the rows are the full fold's.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple, cast

from controlplane.core.ports import EventLog, Stored, SubjectReads
from controlplane.core.projections import ClusterState
from controlplane.store.rebuild import candidates, newest_snapshot, store_of
from schemas.events import AnyEvent, Event, ReplicaEvent, Skipped
from schemas.subjects import model_events_filter, replica_events_filter

Item = AnyEvent | Skipped
Row = tuple[int, str, str, str, str | None]  # (seq, state, level, desired, anomaly) a replica was left in
MAX_LIMIT = 10_000  # events one history page may show
FIRST_WINDOW = 2_000  # sequences the newest events are first looked for in (doubled until enough are found)
JUMP_EVENTS = 2_000  # a later snapshot is loaded rather than folding through more events than this


class Step(NamedTuple):
    """One shown event, the replica row it left (None for a model-level event) and its anomaly."""

    seq: int
    item: AnyEvent
    row: Row | None
    anomaly: str | None


class History(NamedTuple):
    """A page of a model's history, oldest first; `before`: the `before` of the next older page (None: none)."""

    steps: list[Step]
    before: int | None


def matches(item: Item, model_key: str, replica_id: int | None) -> bool:
    """Is `item` an event of the model (and, given one, of that replica)?"""
    if not isinstance(item, Event) or item.model_key != model_key:
        return False
    return replica_id is None or (isinstance(item, ReplicaEvent) and item.replica_id == replica_id)


def left_row(state: ClusterState, seq: int, item: ReplicaEvent, anomalies_before: int) -> Row:
    """What the replica event just folded into `state` left: the replica's state, level, desired level
    and the anomaly it raised (empty strings: the event named no replica the fold holds)."""
    r = state.replicas.get((item.model_key, item.replica_id))
    anomaly = state.anomalies[-1].message if state.anomaly_count > anomalies_before and state.anomalies else None
    return (seq, str(r.state), str(r.level), str(r.desired), anomaly) if r else (seq, "", "", "", anomaly)


def steps_of(state: ClusterState, batch: list[Stored], model_key: str, replica_id: int | None,
             lo: int = 1) -> list[Step]:
    """Fold `batch` into `state`; the steps of the model (or replica) at `lo` or later, each with what it left."""
    out: list[Step] = []
    for seq, item in batch:
        before = state.anomaly_count
        state.apply(seq, item)
        if seq < lo or not matches(item, model_key, replica_id):
            continue
        ev = cast(AnyEvent, item)  # matches() holds it is an event
        anomaly = state.anomalies[-1].message if state.anomaly_count > before and state.anomalies else None
        row = left_row(state, seq, ev, before) if isinstance(ev, ReplicaEvent) else None
        out.append(Step(seq, ev, row, anomaly))
    return out


async def newest_events(log: EventLog, model_key: str, *, replica_id: int | None = None, before: int | None = None,
                        limit: int, last_seq: int | None = None) -> tuple[list[Stored], int | None]:
    """The newest `limit` events of the model (or replica) below `before` (default: all), oldest first,
    and the `before` of the next older page (None: there are no older ones)."""
    last = await log.last_seq() if last_seq is None else last_seq
    hi = last if before is None else min(before - 1, last)
    filters = model_events_filter(model_key) if replica_id is None else replica_events_filter(model_key, replica_id)
    width = max(FIRST_WINDOW, 4 * limit)
    found: list[Stored] = []
    while hi >= 1 and len(found) <= limit:  # one more than shown: whether older ones exist
        lo = max(1, hi - width + 1)
        chunk = [p for p in await _read_filtered(log, filters, lo, hi) if matches(p[1], model_key, replica_id)]
        found = chunk + found
        hi, width = lo - 1, width * 2
    shown = found[-limit:] if limit else []
    return shown, (shown[0][0] if len(found) > limit and shown else None)


async def _read_filtered(log: EventLog, filters: list[str], lo: int, hi: int) -> list[Stored]:
    """The events on `filters` with lo <= seq <= hi, in order (a log without subject reads: all, read and sorted out)."""
    if not isinstance(log, SubjectReads):
        return [p async for p in log.read(lo, stop_seq=hi)]
    out: list[Stored] = []
    for f in filters:
        out.extend([p async for p in log.read_subject(f, lo, stop_seq=hi)])
    out.sort(key=lambda p: p[0])
    return out


async def model_history(log: EventLog, model_key: str, *, replica_id: int | None = None, before: int | None = None,
                        limit: int) -> History:
    """A page of the model's (or replica's) history: its newest `limit` events below `before`, each with
    the state it left, folded as the module docstring says."""
    last = await log.last_seq()
    shown, older = await newest_events(log, model_key, replica_id=replica_id, before=before, limit=limit,
                                       last_seq=last)
    if not shown:
        return History([], older)
    at = sorted(n.seq for n in candidates(await _names(log), until_seq=last))
    refused: set[str] = set()
    lo = shown[0][0]
    state: ClusterState | None = None
    steps: list[Step] = []
    for seq, _ in shown:
        if state is not None and seq <= state.seq:
            continue  # folded with an earlier one
        i = bisect.bisect_right(at, seq - 1)  # snapshots at or before seq - 1: at[:i]
        if state is None or (i and at[i - 1] - state.seq > JUMP_EVENTS):
            start = await newest_snapshot(log, until_seq=seq - 1, last_seq=last, refused=refused,
                                          after_seq=-1 if state is None else state.seq)
            if state is None or start.name is not None:
                state = start.state
        async for batch in log.read_batches(state.seq + 1, stop_seq=seq):
            steps.extend(steps_of(state, batch, model_key, replica_id, lo))
    return History(steps, older)


async def _names(log: EventLog) -> list[str]:
    """The stored snapshots' names ([] when there is no store or it cannot be listed: `newest_snapshot` says why)."""
    store = store_of(log)
    if store is None:
        return []
    try:
        return await store.snapshot_names()
    except Exception:  # noqa: BLE001 - no bucket, no right to read it, a timeout: fold from the start
        return []
