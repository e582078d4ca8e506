"""`ndif history` / `ndif status MODEL` read a model's events by subject and fold from the newest snapshot
before the first one shown (controlplane/store/history.py): the rows are the full fold's, with snapshots
stored or not, and the log is not read from seq 1 when a snapshot lies before what is shown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.ports import Stored
from controlplane.core.projections import ClusterState
from controlplane.core.projections.snapshot import encode_stored, snapshot_name
from controlplane.store import history as H
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.events import ReplicaEvent
from schemas.status import EvictionReason, Level
from tests.strategies import MODELS, NODES, _env, histories, node_joined
from tests.unit.test_snapshots import stored_log

THIRD = 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/third", "revision": null}'
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class CountingLog(MemoryEventLog):
    """A memory log that records every sequence it hands out: of the whole log, and by subject."""

    def __init__(self) -> None:
        super().__init__()
        self.log_seqs: list[int] = []
        self.subject_seqs: list[int] = []

    async def read(self, start_seq: int = 1, *, start_time: datetime | None = None,
                   stop_seq: int | None = None) -> AsyncIterator[Stored]:
        async for pair in super().read(start_seq, start_time=start_time, stop_seq=stop_seq):
            self.log_seqs.append(pair[0])
            yield pair

    async def read_subject(self, subject: str, start_seq: int = 1, *,
                           stop_seq: int | None = None) -> AsyncIterator[Stored]:
        async for pair in super().read_subject(subject, start_seq, stop_seq=stop_seq):
            self.subject_seqs.append(pair[0])
            yield pair


def stored(events: list[E.Event]) -> CountingLog:
    log = CountingLog()
    stored_log(events, log)
    return log


async def snapshot_at(log: CountingLog, seq: int) -> None:
    state = ClusterState()
    async for s, item in MemoryEventLog.read(log, 1, stop_seq=seq):
        state.apply(s, item)
    header, data = encode_stored(state)
    await log.save_snapshot(snapshot_name(header), data)


def full_fold_rows(log: CountingLog, mk: str, rid: int | None) -> list[tuple[Any, ...]]:
    """What `ndif history` printed before: every event of the model, folded from seq 1, with what it left
    (the anomaly found by its seq, as that code did)."""
    state = ClusterState()
    rows = []
    for i, body in enumerate(log._bodies):
        seq = i + 1
        item = E.stored_item(log._subjects[i], body)
        state.apply(seq, item)
        if not H.matches(item, mk, rid):
            continue
        after = None
        if isinstance(item, ReplicaEvent):
            r = state.replicas.get((mk, item.replica_id))
            after = (str(r.state), str(r.level), str(r.desired)) if r else ("", "", "")
        anomaly = next((x.message for x in reversed(state.anomalies) if x.seq == seq), None)
        rows.append((seq, item.event_id, after, anomaly))  # type: ignore[union-attr]
    return rows


def shown_rows(steps: list[H.Step]) -> list[tuple[Any, ...]]:
    return [(s.seq, s.item.event_id, s.row[1:4] if s.row else None, s.anomaly) for s in steps]


@contextmanager
def small_steps() -> Iterator[None]:
    """Windows and jumps at the scale of a generated history, so every path is taken."""
    saved = H.FIRST_WINDOW, H.JUMP_EVENTS
    H.FIRST_WINDOW, H.JUMP_EVENTS = 1, 0
    try:
        yield
    finally:
        H.FIRST_WINDOW, H.JUMP_EVENTS = saved


@SETTINGS
@given(histories(), st.data())
def test_a_page_is_the_full_folds_rows_with_or_without_snapshots(events: list[E.Event], data: st.DataObject) -> None:
    log = stored(events)
    n = len(events)
    at = data.draw(st.lists(st.integers(1, n), max_size=4, unique=True), label="snapshots at")
    mk = data.draw(st.sampled_from(MODELS))
    rid = data.draw(st.none() | st.integers(0, 3))
    limit = data.draw(st.integers(1, 12))
    before = data.draw(st.none() | st.integers(1, n + 2))
    want = [r for r in full_fold_rows(log, mk, rid) if before is None or r[0] < before]

    async def page() -> H.History:
        for seq in at:
            await snapshot_at(log, seq)
        with small_steps():
            return await H.model_history(log, mk, replica_id=rid, before=before, limit=limit)

    got = asyncio.run(page())
    assert shown_rows(got.steps) == want[-limit:]
    assert got.before == (want[-limit][0] if len(want) > limit else None)


def long_history(lifecycles: int) -> list[E.Event]:
    """Three models' replicas loaded and unloaded in turn: 5 events a lifecycle, every event valid."""
    models = [*MODELS, THIRD]
    out: list[E.Event] = [node_joined(n) for n in NODES]
    out += [E.ModelRegistered(**_env("controller"), model_key=m, checkpoint="/ckpt", size_bytes=2**30) for m in models]
    for i in range(lifecycles):
        rep = {"model_key": models[i % 3], "replica_id": i // 3, "node_id": NODES[i % 2]}
        out += [E.ReplicaScheduled(**_env("controller"), **rep, gpu_indices=(0,), bytes_per_gpu=2**30),
                E.ReplicaLoading(**_env("agent"), **rep), E.ReplicaLoaded(**_env("agent"), **rep, load_seconds=0.5),
                E.ReplicaEvictionRequested(**_env("controller"), **rep, reason=EvictionReason.ADMIN, target=Level.COLD),
                E.ReplicaUnloaded(**_env("agent"), **rep)]
    return out


def test_a_page_reads_from_the_snapshot_before_it_not_from_seq_1() -> None:
    events = long_history(2_400)  # 12,005 events
    mk = MODELS[1]
    every = 1_000

    async def run(with_snapshots: bool) -> tuple[CountingLog, H.History]:
        log = stored(events)
        if with_snapshots:
            for seq in range(every, len(events) + 1, every):
                await snapshot_at(log, seq)
        mid = await H.model_history(log, mk, limit=20, before=6_000)
        assert shown_rows(mid.steps) == [r for r in full_fold_rows(log, mk, None) if r[0] < 6_000][-20:]
        log.log_seqs.clear()
        log.subject_seqs.clear()
        return log, await H.model_history(log, mk, limit=20)

    bare, page_bare = asyncio.run(run(False))
    snap, page_snap = asyncio.run(run(True))
    want = full_fold_rows(bare, mk, None)[-20:]
    assert shown_rows(page_bare.steps) == shown_rows(page_snap.steps) == want
    first, last = want[0][0], want[-1][0]
    assert min(bare.log_seqs) == 1  # no snapshot: the fold starts at the log's start
    # With snapshots: the fold starts at the one before the first event shown (one event read to check it).
    start = (first - 1) // every * every
    assert min(snap.log_seqs) == start and sorted(set(snap.log_seqs)) == [start, *range(start + 1, last + 1)]
    assert len(snap.log_seqs) <= every + (last - first) + 1
    # By subject: the model's events of the first window only, not its whole history.
    assert min(snap.subject_seqs) > len(events) - 2 * H.FIRST_WINDOW
    assert len(snap.subject_seqs) < 2 * H.FIRST_WINDOW


def test_status_model_reads_only_the_newest_events_by_subject() -> None:
    events = long_history(2_400)
    log = stored(events)
    mk = MODELS[0]
    found, before = asyncio.run(H.newest_events(log, mk, limit=12))
    want = [(s, e) for s, e in enumerate(events, 1) if e.model_key == mk][-12:]
    assert [(s, e.event_id) for s, e in found] == [(s, e.event_id) for s, e in want]  # type: ignore[union-attr]
    assert before == want[0][0]
    assert log.log_seqs == [] and min(log.subject_seqs) > len(events) - 2 * H.FIRST_WINDOW


def test_sparse_events_jump_from_snapshot_to_snapshot() -> None:
    """A replica whose events lie far apart: each shown event is reached from the snapshot before it,
    never by folding the whole stretch between them."""
    events = long_history(2_400)
    mk, rid = THIRD, 0  # replica 0 of the third model: its 5 events near the start ...
    tail = [E.ReplicaScheduled(**_env("controller"), model_key=mk, replica_id=0, node_id=NODES[0], gpu_indices=(1,),
                               bytes_per_gpu=2**30)]
    events = events[:6_000] + tail + events[6_000:]  # ... and one in the middle
    every = 1_000

    async def run() -> tuple[CountingLog, H.History]:
        log = stored(events)
        for seq in range(every, len(events) + 1, every):
            await snapshot_at(log, seq)
        log.log_seqs.clear()
        return log, await H.model_history(log, mk, replica_id=rid, limit=6)

    log, page = asyncio.run(run())
    assert shown_rows(page.steps) == full_fold_rows(log, mk, rid)[-6:]
    assert len(log.log_seqs) < 2 * every + 20  # two short folds, not the 6,000 events between
