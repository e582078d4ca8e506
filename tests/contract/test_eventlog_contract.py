"""One contract, every EventLog: the in-memory log and JetStream against a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio

from controlplane.core.projections import ClusterState, decode_snapshot, encode_snapshot, fold
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.errors import ConflictError, InvalidCommand
from tests.conftest import fresh_event_log
from tests.strategies import _env, node_joined


@pytest_asyncio.fixture(params=["memory", "jetstream"])
async def log(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    if request.param == "memory":
        yield MemoryEventLog()
        return
    nats_server = request.getfixturevalue("nats_server")  # only the JetStream cases start a server
    js_log = await fresh_event_log(nats_server.url)
    yield js_log
    await js_log.close()


def loads(n: int, start: int = 0) -> list[E.Event]:
    return [E.ReplicaLoading(**_env("agent"), model_key="m", replica_id=start + i) for i in range(n)]


async def collect(it: AsyncIterator, n: int | None = None) -> list:
    out = []
    async for pair in it:
        out.append(pair)
        if n is not None and len(out) == n:
            break
    return out


async def test_append_one_and_many(log):
    assert await log.last_seq() == 0
    r1 = await log.append([node_joined("n1")], 0)
    assert (r1.first_seq, r1.last_seq, r1.already_appended) == (1, 1, False)
    r2 = await log.append(loads(5), 1)
    assert (r2.first_seq, r2.last_seq) == (2, 6)
    got = await collect(log.read())
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]
    assert [e.replica_id for _, e in got[1:]] == [0, 1, 2, 3, 4]


async def test_stale_expectation_is_a_conflict_and_appends_nothing(log):
    await log.append(loads(2), 0)
    for batch in (loads(1, 10), loads(3, 10)):
        with pytest.raises(ConflictError) as exc:
            await log.append(batch, 1)
        assert exc.value.actual_last_seq == 2 and exc.value.expected_last_seq == 1 and exc.value.retryable
    assert await log.last_seq() == 2


async def test_resend_is_already_appended_not_a_conflict(log):
    one, many = loads(1), loads(4, 1)
    await log.append(one, 0)
    await log.append(many, 1)
    await log.append(loads(1, 9), 5)  # the log moved on since
    again1 = await log.append(one, 0)
    again2 = await log.append(many, 1)
    assert (again1.first_seq, again1.last_seq, again1.already_appended) == (1, 1, True)
    assert (again2.first_seq, again2.last_seq, again2.already_appended) == (2, 5, True)
    assert await log.last_seq() == 6


async def test_bad_batches_are_invalid(log):
    with pytest.raises(InvalidCommand):
        await log.append([], 0)
    with pytest.raises(InvalidCommand, match="1000"):
        await log.append(loads(1001), 0)
    e = loads(1)[0]
    with pytest.raises(InvalidCommand, match="twice"):
        await log.append([e, e], 0)
    assert await log.last_seq() == 0


async def test_read_from_seq_time_and_to_stop(log):
    evs = loads(6)
    await log.append(evs[:3], 0)
    await asyncio.sleep(0.01)
    between = datetime.now(UTC)
    await asyncio.sleep(0.01)
    await log.append(evs[3:], 3)
    assert [s for s, _ in await collect(log.read(4))] == [4, 5, 6]
    assert [s for s, _ in await collect(log.read(2, stop_seq=3))] == [2, 3]
    assert [s for s, _ in await collect(log.read(start_time=between))] == [4, 5, 6]
    assert await collect(log.read(7)) == []
    # A time after the last event: nothing.
    assert await collect(log.read(start_time=datetime.now(UTC) + timedelta(days=1))) == []


async def test_follow_sees_live_appends_in_order(log):
    await log.append(loads(2), 0)
    task = asyncio.create_task(collect(log.follow(2), n=4))
    await asyncio.sleep(0.05)
    await log.append(loads(3, 2), 2)
    got = await asyncio.wait_for(task, 5)
    assert [s for s, _ in got] == [2, 3, 4, 5]


async def test_snapshot_plus_tail_equals_full_fold(log):
    await log.append([node_joined("node-a.cluster")], 0)
    sched = E.ReplicaScheduled(**_env("controller"), model_key="m", replica_id=0, node_id="node-a.cluster",
                               gpu_indices=(0,), bytes_per_gpu=5)
    await log.append([sched], 1)
    prefix = fold(await collect(log.read()), ClusterState())
    await log.save_snapshot("cluster", encode_snapshot(prefix))
    await log.append([E.ReplicaLoaded(**_env("agent"), model_key="m", replica_id=0, node_id="node-a.cluster")], 2)
    snap = decode_snapshot(await log.load_snapshot("cluster"))
    resumed = fold(await collect(log.read(snap.seq + 1)), snap)
    assert resumed == fold(await collect(log.read()), ClusterState())
    assert await log.load_snapshot("absent") is None


async def test_snapshots_are_listed_loaded_and_deleted_by_name(log):
    """What the rebuild and the writer need of a store: names, whole bytes back (several chunks), delete."""
    await log.append([node_joined("node-a.cluster")], 0)
    big = bytes(range(256)) * 5000  # 1.28 MB: several object-store chunks (512 KiB each)
    await log.save_snapshot("cluster.v2.000000000001.t-", big)
    await log.save_snapshot("cluster.v2.000000000002.t-", b"two")
    assert sorted(await log.snapshot_names()) == ["cluster.v2.000000000001.t-", "cluster.v2.000000000002.t-"]
    assert await log.load_snapshot("cluster.v2.000000000001.t-") == big
    await log.save_snapshot("cluster.v2.000000000002.t-", b"again")  # replaced, not added
    assert await log.load_snapshot("cluster.v2.000000000002.t-") == b"again"
    await log.delete_snapshot("cluster.v2.000000000002.t-")
    await log.delete_snapshot("never-there")
    assert await log.snapshot_names() == ["cluster.v2.000000000001.t-"]
    assert await log.load_snapshot("cluster.v2.000000000002.t-") is None
    await log.delete_snapshot("cluster.v2.000000000001.t-")


async def test_a_rebuild_starts_from_the_stored_snapshot(log):
    from controlplane.core.projections.snapshot import encode_stored, snapshot_name
    from controlplane.store.rebuild import rebuild

    await log.append([node_joined("node-a.cluster")], 0)
    await log.append(loads(5), 1)
    prefix = fold(await collect(log.read(stop_seq=4)), ClusterState())
    header, data = encode_stored(prefix)
    await log.save_snapshot(snapshot_name(header), data)
    whole = fold(await collect(log.read()), ClusterState())
    assert await rebuild(log) == whole
    assert await rebuild(log, until_seq=5) == fold(await collect(log.read(stop_seq=5)), ClusterState())
    await log.delete_snapshot(snapshot_name(header))


async def test_batches_are_the_same_events_in_order(log):
    await log.append(loads(7), 0)
    flat = [s for batch in [b async for b in log.read_batches(2, stop_seq=6)] for s, _ in batch]
    assert flat == [2, 3, 4, 5, 6]
    got: list[int] = []

    async def follow():
        async for batch in log.follow_batches(5):
            got.extend(s for s, _ in batch)
            if got and got[-1] >= 9:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.05)
    await log.append(loads(2, 7), 7)
    await asyncio.wait_for(task, 5)
    assert got == [5, 6, 7, 8, 9]


async def test_observed_facts_append_without_expectation(log):
    await log.append(loads(2), 0)
    r = await log.append(loads(1, 5), None)
    assert (r.first_seq, r.last_seq) == (3, 3)
    r = await log.append(loads(3, 6), None)
    assert (r.first_seq, r.last_seq) == (4, 6) and await log.last_seq() == 6


async def test_subject_reads_hand_out_only_the_filters_events(log):
    from controlplane.core.ports import SubjectReads
    from schemas.subjects import model_events_filter, replica_events_filter

    assert isinstance(log, SubjectReads)
    other = [E.ReplicaLoading(**_env("agent"), model_key="other", replica_id=i) for i in range(3)]
    await log.append([node_joined("node-a.cluster")], 0)
    await log.append(loads(3), 1)  # seqs 2-4: model "m", replicas 0-2
    await log.append(other, 4)  # 5-7
    await log.append(loads(2, 3), 7)  # 8-9: replicas 3-4
    replica_filter, model_filter = model_events_filter("m")[1], replica_events_filter("m", 1)[0]
    assert [s for s, _ in await collect(log.read_subject(replica_filter))] == [2, 3, 4, 8, 9]
    assert [s for s, _ in await collect(log.read_subject(replica_filter, 3, stop_seq=8))] == [3, 4, 8]
    assert [(s, e.replica_id) for s, e in await collect(log.read_subject(model_filter))] == [(3, 1)]
    assert await collect(log.read_subject(model_events_filter("m")[0])) == []
