"""Snapshots in use: a fold started from a stored snapshot plus the tail equals the fold of the whole log,
whatever is in the store (another schema, corrupt bytes, a snapshot of a log that was reset); the
fold's memory stays bounded; the controller's writer stores one every N events, keeps a retention.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from controlplane.core.projections import ClusterState, encode_snapshot, fold, replay
from controlplane.core.projections import base as base_mod
from controlplane.core.projections import cluster as cluster_mod
from controlplane.core.projections.cluster import SNAPSHOT_SCHEMA
from controlplane.core.projections.snapshot import (
    SnapshotHeader,
    decode_stored,
    encode_stored,
    parse_name,
    snapshot_name,
)
from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.service.snapshots import SnapshotWriter
from controlplane.store.memlog import MemoryEventLog
from controlplane.store.rebuild import candidates, rebuild
from schemas import events as E
from schemas.events import encode_event, event_subject
from schemas.status import EvictionReason, Level, ReplicaState
from tests.strategies import _env, histories, numbered, scripted_history

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stored_log(events: list[E.Event], log: MemoryEventLog | None = None) -> MemoryEventLog:
    """A log (`log`, or a new one) holding exactly these events, duplicates included (as a foreign
    writer could store them)."""
    log = log if log is not None else MemoryEventLog()
    for ev in events:
        log.store_raw(event_subject(ev), encode_event(ev), ev.event_id, ev.ts)
    return log


async def put(log: MemoryEventLog, state: ClusterState) -> str:
    header, data = encode_stored(state)
    name = snapshot_name(header)
    await log.save_snapshot(name, data)
    return name


def full(pairs: list[tuple[int, E.Event]]) -> ClusterState:
    return fold(pairs, ClusterState())


def used(logs: list[dict]) -> list[str | None]:
    """The snapshot each rebuild started from (None: the start of the log), from its log lines."""
    return [e["snapshot"] for e in logs if e["event"] == "fold_rebuilt"]


def ignored(logs: list[dict]) -> list[str]:
    return [e["reason"] for e in logs if e["event"] == "snapshot_ignored"]


def with_schema(data: bytes, schema: int) -> tuple[str, bytes]:
    """The same snapshot as another schema would have written it (name and header)."""
    head, _, body = data.partition(b"\n")
    h = msgspec.json.decode(head, type=SnapshotHeader)
    h = msgspec.structs.replace(h, schema=schema)
    return snapshot_name(h), msgspec.json.encode(h) + b"\n" + body


def corrupt(data: bytes, how: str) -> bytes:
    head, _, body = data.partition(b"\n")
    match how:
        case "flip":  # one byte of the body changed: the digest no longer matches
            i = len(body) // 2
            return head + b"\n" + body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1:]
        case "truncated":
            return data[: len(data) // 2]
        case "garbage":
            return b"\xff\xfe not a snapshot \x00" * 7
        case "no-header":
            return body
        case "not-zlib":  # a well-formed header over a body that does not inflate
            bad = b'{"kind":"cluster","schema":%d}' % SNAPSHOT_SCHEMA
            h = msgspec.json.decode(head, type=SnapshotHeader)
            import hashlib

            h = msgspec.structs.replace(h, body_bytes=len(bad), body_sha256=hashlib.sha256(bad).hexdigest())
            return msgspec.json.encode(h) + b"\n" + bad
        case _:  # a well-formed header over a body of the wrong shape
            import zlib

            bad = zlib.compress(b'{"kind":"cluster","schema":%d,"seq":"x"}' % SNAPSHOT_SCHEMA)
            h = msgspec.json.decode(head, type=SnapshotHeader)
            import hashlib

            h = msgspec.structs.replace(h, body_bytes=len(bad), body_sha256=hashlib.sha256(bad).hexdigest())
            return msgspec.json.encode(h) + b"\n" + bad


# ---- the law: snapshot + tail == the whole fold, whatever the store holds ----------------------------------


@SETTINGS
@given(histories(), st.data())
def test_rebuild_equals_the_full_fold_at_any_cut_and_any_past_point(events, data):
    pairs = numbered(events)
    whole = full(pairs)
    cuts = data.draw(st.lists(st.integers(0, len(pairs)), min_size=1, max_size=4), label="snapshots at")
    until = data.draw(st.integers(0, len(pairs)), label="until_seq")
    k = data.draw(st.integers(0, len(pairs) - 1), label="until_time of event")

    async def run() -> None:
        log = stored_log(events)
        for c in cuts:
            await put(log, full(pairs[:c]))
        with capture_logs() as logs:
            assert await rebuild(log) == whole
            assert await rebuild(log, until_seq=until) == full(pairs[:until])
        # Each started from the newest snapshot at or before its point, never from a later one.
        assert used(logs) == [snapshot_name(encode_stored(full(pairs[:max(cuts)]))[0]),
                              snapshot_name(encode_stored(full(pairs[:max(c for c in cuts if c <= until)]))[0])
                              if any(c <= until for c in cuts) else None]
        t = pairs[k][1].ts
        assert await rebuild(log, until_time=t) == replay(pairs, until_time=t)

    asyncio.run(run())


@SETTINGS
@given(histories(), histories(), st.data())
def test_a_bad_snapshot_is_ignored_and_the_fold_is_the_full_one(events, other, data):
    """Across a schema change, with a corrupt snapshot, with a snapshot of a log that was reset:
    the snapshot is ignored (with a log line) and the fold is exactly the fold from the start."""
    pairs = numbered(events)
    whole = full(pairs)
    cut = data.draw(st.integers(1, len(pairs)), label="cut")
    case = data.draw(st.sampled_from(["old-schema", "new-schema", "flip", "truncated", "garbage", "no-header",
                                      "not-zlib", "wrong-shape", "reset"]), label="case")

    async def run() -> None:
        log = stored_log(events)
        header, good = encode_stored(full(pairs[:cut]))
        if case in ("old-schema", "new-schema"):
            name, bad = with_schema(good, SNAPSHOT_SCHEMA - 1 if case == "old-schema" else SNAPSHOT_SCHEMA + 1)
        elif case == "reset":  # the log was started anew: its snapshots were of another history
            other_pairs = numbered(other)
            c = data.draw(st.integers(1, len(other_pairs)), label="cut in the old log")
            h, bad = encode_stored(full(other_pairs[:c]))
            name = snapshot_name(h)
        else:
            name, bad = snapshot_name(header), corrupt(good, case)
        await log.save_snapshot(name, bad)
        with capture_logs() as logs:
            got = await rebuild(log)
        assert got == whole
        if case == "reset" and encode_stored(got)[0].seq >= 1:
            # The old log's snapshot may match by chance only if it names this log's event: never here
            # (generated ids are unique), so it was refused as another log's.
            assert used(logs) == [None] and any("another log" in r or "no event" in r for r in ignored(logs))
        elif case in ("old-schema", "new-schema"):
            assert used(logs) == [None] and any("schema" in r for r in ignored(logs))
        elif case != "reset":
            assert used(logs) == [None] and ignored(logs), logs

    asyncio.run(run())


async def test_an_older_snapshot_of_this_schema_is_used_when_the_newest_is_of_another():
    pairs = numbered(scripted_history(12))
    log = stored_log([e for _, e in pairs])
    mine = await put(log, full(pairs[:10]))
    name, data = with_schema(encode_stored(full(pairs[:30]))[1], SNAPSHOT_SCHEMA - 1)
    await log.save_snapshot(name, data)
    with capture_logs() as logs:
        assert await rebuild(log) == full(pairs)
    assert used(logs) == [mine]
    assert ignored(logs) == [f"schema {SNAPSHOT_SCHEMA - 1}; this version reads schema {SNAPSHOT_SCHEMA}"]


async def test_a_snapshot_past_the_end_or_naming_another_event_is_refused_in_words():
    pairs = numbered(scripted_history(6))
    log = stored_log([e for _, e in pairs])
    other = numbered(scripted_history(20))  # same shape, other ids: another log's history
    await put(log, full(other[: len(pairs) + 5]))
    await put(log, full(other[:7]))
    with capture_logs() as logs:
        assert await rebuild(log) == full(pairs)
    reasons = ignored(logs)
    assert len(reasons) == 2 and "past the log's end" in reasons[0] and "a snapshot of another log" in reasons[1]
    assert "the log's event at seq 7 is" in reasons[1]


async def test_tries_are_bounded_then_the_fold_starts_from_the_beginning():
    pairs = numbered(scripted_history(10))
    log = stored_log([e for _, e in pairs])
    for c in (5, 10, 15, 20):
        h, data = encode_stored(full(pairs[:c]))
        await log.save_snapshot(snapshot_name(h), corrupt(data, "flip"))
    with capture_logs() as logs:
        assert await rebuild(log) == full(pairs)
    assert used(logs) == [None] and len(ignored(logs)) == 3  # MAX_TRIES


def test_names_say_what_a_snapshot_covers_and_refuse_what_is_not_one():
    pairs = numbered(scripted_history(3))
    h, data = encode_stored(full(pairs))
    n = parse_name(snapshot_name(h))
    assert n is not None and (n.kind, n.schema, n.seq) == ("cluster", SNAPSHOT_SCHEMA, len(pairs))
    assert n.max_ts_us is not None and n.max_ts_us == int(full(pairs).max_ts.timestamp() * 1_000_000)  # type: ignore[union-attr]
    for bad in ("cluster", "cluster.v2.12.t1", "cluster.v2.000000000012", "../x.v2.000000000012.t1", ""):
        assert parse_name(bad) is None
    assert candidates(["cluster", snapshot_name(h), "cluster.v1.000000000001.t-"]) == [n]
    assert candidates([snapshot_name(h)], until_seq=len(pairs) - 1) == []
    t = datetime(2000, 1, 1, tzinfo=UTC)
    assert candidates([snapshot_name(h)], until_time=t) == []
    # The body alone (the codec the contract tests use) is not a stored snapshot.
    assert isinstance(decode_stored(encode_snapshot(full(pairs))), str)
    # A body that inflates past the limit is refused before it is decoded.
    import hashlib
    import zlib

    from controlplane.core.projections import snapshot as snap_mod

    saved, snap_mod.MAX_SNAPSHOT_BYTES = snap_mod.MAX_SNAPSHOT_BYTES, 1000
    try:
        bomb = zlib.compress(b" " * 5000, 9)
        hb = msgspec.structs.replace(h, body_bytes=len(bomb), body_sha256=hashlib.sha256(bomb).hexdigest())
        assert "inflates past" in decode_stored(msgspec.json.encode(hb) + b"\n" + bomb)  # type: ignore[operator]
    finally:
        snap_mod.MAX_SNAPSHOT_BYTES = saved
    got = decode_stored(data)
    assert not isinstance(got, str) and got[1] == full(pairs)


# ---- memory bounded by the cluster, not the history ------------------------------------------------------


@contextlib.contextmanager
def small_bounds(ids: int = 3, commands: int = 2, gone: int = 1) -> Iterator[None]:
    saved = base_mod.EVENT_ID_WINDOW, cluster_mod.MAX_COMMANDS_KEPT, cluster_mod.MAX_GONE_KEPT
    base_mod.EVENT_ID_WINDOW, cluster_mod.MAX_COMMANDS_KEPT, cluster_mod.MAX_GONE_KEPT = ids, commands, gone
    try:
        yield
    finally:
        base_mod.EVENT_ID_WINDOW, cluster_mod.MAX_COMMANDS_KEPT, cluster_mod.MAX_GONE_KEPT = saved


@st.composite
def commanded(draw: st.DrawFn) -> list[E.Event]:
    """Histories whose events carry command ids from a small pool (records made, extended, forgotten)."""
    events = draw(histories())
    ids = st.sampled_from([None, "c1", "c2", "c3", "c4"])
    return [msgspec.structs.replace(e, command_id=draw(ids)) if e.command_id is None else e for e in events]


@SETTINGS
@given(commanded(), st.data())
def test_with_the_bounds_reached_snapshot_plus_tail_still_equals_the_full_fold(events, data):
    """The windows (event ids, command records, gone replicas) are forgotten in an order a snapshot
    restores exactly: the law holds where they overflow, and they stay within their bounds."""
    pairs = numbered(events)
    with small_bounds():
        whole = full(pairs)
        for cut in sorted(set(data.draw(st.lists(st.integers(0, len(pairs)), min_size=1, max_size=5)))):
            got = decode_stored(encode_stored(full(pairs[:cut]))[1])
            assert not isinstance(got, str), got
            assert fold(pairs[cut:], got[1]) == whole, f"cut at {cut}"
        assert len(whole.event_ids) <= 3 and len(whole.id_order) <= 3 and len(whole.commands) <= 2
        gone = [r for r in whole.replicas.values()
                if r.state is ReplicaState.UNLOADED and not r.on_gpu and not r.cpu_bytes and r.desired is not Level.HOT]
        for mk in {r.model_key for r in gone}:
            assert sum(1 for r in gone if r.model_key == mk) <= 1


def _cycle(mk: str, rid: int) -> list[E.Event]:
    rep = {"model_key": mk, "replica_id": rid, "node_id": "node-a.cluster"}
    return [E.ReplicaScheduled(**_env("controller"), **rep, gpu_indices=(0,), bytes_per_gpu=2**30),
            E.ReplicaLoading(**_env("agent"), **rep), E.ReplicaLoaded(**_env("agent"), **rep),
            E.ReplicaEvictionRequested(**_env("controller"), **rep, reason=EvictionReason.ADMIN, target=Level.COLD),
            E.ReplicaUnloaded(**_env("agent"), **rep)]


def test_a_model_keeps_its_last_gone_replicas_and_a_late_report_of_a_forgotten_one_changes_nothing():
    from tests.strategies import MODELS, node_joined

    mk = MODELS[0]
    events: list[E.Event] = [node_joined("node-a.cluster"),
                             E.ModelRegistered(**_env("controller"), model_key=mk, checkpoint="/c", size_bytes=2**30)]
    n = cluster_mod.MAX_GONE_KEPT + 5
    for rid in range(n):
        events += _cycle(mk, rid)
    s = full(numbered(events))
    assert sorted(rid for _, rid in s.replicas) == list(range(5, n))  # the oldest five forgotten
    assert s.models[mk].next_replica_id == n and s.anomaly_count == 0
    late = E.ReplicaUnloaded(**_env("agent"), model_key=mk, replica_id=0, node_id="node-a.cluster")
    odd = E.ReplicaLoaded(**_env("agent"), model_key=mk, replica_id=1, node_id="node-a.cluster")
    after = full(numbered([*events, late, odd]))
    assert after.to_snapshot().replicas == s.to_snapshot().replicas
    assert after.anomaly_count == 1 and "unloaded and forgotten" in after.anomalies[-1].message


def test_the_event_id_window_forgets_the_oldest_and_a_re_append_within_it_changes_nothing():
    pairs = numbered(scripted_history(40))
    with small_bounds(ids=10, commands=10_000, gone=10_000):
        s = full(pairs)
        assert list(s.id_order) == [e.event_id for _, e in pairs[-10:]] and s.event_ids == set(s.id_order)
        again = full([*pairs, (len(pairs) + 1, pairs[-3][1])])
        assert again.seq == len(pairs) + 1 and again.to_snapshot().replicas == s.to_snapshot().replicas
        assert again.last_event_id == pairs[-3][1].event_id


# ---- the writer ---------------------------------------------------------------------------------------------


async def test_the_writer_stores_one_every_n_events_and_keeps_its_retention():
    pairs = numbered(scripted_history(12))
    log = stored_log([e for _, e in pairs])
    w = await SnapshotWriter(log, every=10, every_s=0, keep=2).start(await log.last_seq())
    state = ClusterState()
    for seq, item in pairs:
        state.apply(seq, item)
        w.after_batch(state)
        await asyncio.sleep(0)
    await w.stop()
    names = sorted(await log.snapshot_names())
    seqs = [parse_name(n).seq for n in names]  # type: ignore[union-attr]
    assert w.written == len(pairs) // 10 and seqs == [10 * (len(pairs) // 10) - 10, 10 * (len(pairs) // 10)]
    with capture_logs() as logs:
        assert await rebuild(log) == full(pairs)
    assert used(logs) == [names[-1]]


async def test_the_writer_writes_by_time_only_when_the_log_moved_and_removes_what_is_past_the_end():
    pairs = numbered(scripted_history(4))
    log = stored_log([e for _, e in pairs])
    stale, _ = encode_stored(full(numbered(scripted_history(30))))
    await log.save_snapshot(snapshot_name(stale), b"x")
    w = await SnapshotWriter(log, every=0, every_s=3600).start(await log.last_seq())
    assert await log.snapshot_names() == []  # past this log's end: removed
    state = full(pairs)
    assert not w.due(state)  # not an hour yet
    w._written_at -= 3601
    assert w.due(state)
    await w.write_now(state)
    assert not w.due(state)  # nothing moved since
    w._written_at -= 3601
    assert not w.due(state)
    with pytest.raises(ValueError):
        SnapshotWriter(log, every=-1)


async def test_a_controller_starts_from_the_newest_snapshot_and_writes_them_as_the_log_grows():
    pairs = numbered(scripted_history(30))
    log = stored_log([e for _, e in pairs[:50]])
    name = await put(log, full(pairs[:40]))
    with capture_logs() as logs:
        async with Controller(Parts(log, None), policy_interval_s=0.05, snapshot_every=25) as ctl:
            assert ctl.state == full(pairs[:50])
            assert used(logs) == [name]  # folded only the 10 events after it
            for _seq, ev in pairs[50:]:
                await log.append([ev], None)
            for _ in range(200):
                if ctl.state.seq == len(pairs) and ctl.snapshots is not None and ctl.snapshots.written:
                    break
                await asyncio.sleep(0.02)
            assert ctl.state == full(pairs)
    written = [e for e in logs if e["event"] == "snapshot_written"]
    assert written and written[-1]["seq"] >= 65  # 25 events past the one it started from
    with capture_logs() as logs:
        async with Controller(Parts(log, None), policy_interval_s=0.05) as again:
            assert again.state == full(pairs)
    assert used(logs) == [written[-1]["name"]]


class SlowStore(MemoryEventLog):
    """A store whose writes wait until released (a bucket slower than the fold)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def save_snapshot(self, name: str, data: bytes) -> None:
        await self.release.wait()
        await super().save_snapshot(name, data)


async def test_while_a_write_is_in_flight_the_newest_due_one_waits_and_older_ones_are_dropped():
    pairs = numbered(scripted_history(12))
    store = SlowStore()
    w = await SnapshotWriter(store, every=10, every_s=0).start(0)
    state = ClusterState()
    for seq, item in pairs[:45]:
        state.apply(seq, item)
        w.after_batch(state)  # due at 10 (stored slowly), 20 (waits), 30 (replaces 20), 40 (replaces 30)
    await asyncio.sleep(0.05)
    assert w.written == 0 and w.dropped == 2 and w.written_seq == 40
    store.release.set()
    for _ in range(100):
        if w.written == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(parse_name(n).seq for n in await store.snapshot_names()) == [10, 40]  # type: ignore[union-attr]
    await w.stop()
