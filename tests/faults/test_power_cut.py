"""A power cut under the JetStream store: nats-server keeps its store on a filesystem that loses every
write not synced (tools/lazyfs.py); the server's process group is SIGKILLed and the unsynced writes
dropped, then the server starts again on the same store. The cut comes on a fresh store (nothing
written back since the streams were made) and on a settled one (the host wrote everything back).

What is written goes through the project's own code while the cut comes: controller decisions (one
event, and atomic batches) through `JetStreamEventLog.append`, observed facts published to the facts
stream, requests through the SDK's `submit`, statuses kept through the dispatcher's `JetStreamStatusKV`.
With `sync_interval: always` (every config the project writes) every acknowledged item is there
afterwards and the streams take appends; with the server's old default (fsync every 2 minutes) the
same cut loses acknowledged items, which shows the harness cuts.

The filesystem applies metadata (create, rename, unlink) at once and keeps only file data lazy, so
the cut never loses a directory entry: weaker than a real crash there (tools/lazyfs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import random
import signal
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.ops.nats_server import SYNC_ALWAYS, EmbeddedNats
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client
from dataplane.serving.jetstream import JetStreamRequests, JetStreamStatusKV
from schemas import errors as errs
from schemas import events as E
from schemas.requests import StatusUpdate, decode_request, encode_status
from schemas.status import DeploymentOp, EvictionReason, RequestStatus
from schemas.subjects import FACTS_STREAM, HDR_MSG_ID, REQUEST_STATUS_BUCKET, fact_inbox, status_key
from tests.waiting import until
from tools.lazyfs import PAGE, FileView, LazyMount, fuse_problem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROUNDS = 40  # rounds acknowledged before the cut; each writes every kind of item
OLD_DEFAULT = "2m"  # the server's default before the project set `always`
NODE = "node-p"


def need_fuse() -> None:
    """Skip without FUSE, except in CI, where its absence fails (.ci/run installs fuse3)."""
    problem = fuse_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the power-cut tests need FUSE and CI must run them: {problem} (.ci/run installs Debian's "
                    "fuse3; /dev/fuse must be there)", pytrace=False)
    pytest.skip(f"the power-cut tests need FUSE: {problem}")


# ---- the lazy filesystem itself ----------------------------------------------------------------


@given(st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 5 * PAGE), st.binary(min_size=1, max_size=2 * PAGE)),
    st.tuples(st.just("truncate"), st.integers(0, 5 * PAGE)),
    st.tuples(st.just("sync")),
    st.tuples(st.just("drop")),
), max_size=30), st.binary(max_size=3 * PAGE))
@settings(max_examples=300, deadline=None)
def test_a_files_view_is_its_writes_and_the_disk_its_syncs(tmp_path_factory: pytest.TempPathFactory,
                                                           ops: list[tuple[Any, ...]], initial: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "lazyfs-view"  # one file, written anew by each example
    path.write_bytes(initial)
    fd = os.open(path, os.O_RDWR)
    try:
        view, now, disk = FileView(fd, "/f"), bytearray(initial), bytes(initial)
        for op in ops:
            if op[0] == "write":
                _, off, data = op
                now.extend(bytes(max(0, off + len(data) - len(now))))
                now[off:off + len(data)] = data
                view.write(off, data)
            elif op[0] == "truncate":
                now = now[:op[1]] + bytearray(max(0, op[1] - len(now)))
                view.truncate(op[1])
            elif op[0] == "sync":
                view.sync()
                disk = bytes(now)
            else:
                view.discard()
                now = bytearray(disk)
            assert view.size == len(now)
            assert view.read(0, len(now) + PAGE) == now
            assert path.read_bytes() == disk
            assert view.read(PAGE - 7, 3 * PAGE) == now[PAGE - 7:4 * PAGE - 7]
    finally:
        os.close(fd)


def test_the_mount_loses_what_was_not_synced(tmp_path: Path) -> None:
    """Random writes, appends, truncates, O_DSYNC writes, fsyncs and replacements by rename through
    the mount, checked against a model; after a drop each file holds what was synced last, and a
    handle from before the drop answers EIO."""
    need_fuse()
    rng = random.Random(7)
    names = ["a", "b", "c"]
    now: dict[str, bytearray] = {n: bytearray() for n in names}
    synced: dict[str, bytes] = {n: b"" for n in names}
    with LazyMount(tmp_path / "disk", tmp_path / "mnt") as fs:
        mnt = tmp_path / "mnt"
        (mnt / "d").mkdir()
        fds: dict[str, dict[int, int]] = {}

        def open_all(n: str) -> None:
            path = mnt / "d" / n
            fds[n] = {mode: os.open(path, os.O_CREAT | mode, 0o644)
                      for mode in (os.O_RDWR, os.O_WRONLY | os.O_APPEND, os.O_WRONLY | os.O_DSYNC)}

        def close_all(n: str) -> None:
            for fd in fds.pop(n).values():
                os.close(fd)

        for n in names:
            open_all(n)
        for _ in range(600):
            n, op = rng.choice(names), rng.random()
            rw = fds[n][os.O_RDWR]
            data = rng.randbytes(rng.choice((1, 100, PAGE, 3 * PAGE + 5)))
            if op < 0.3:
                off = rng.randrange(0, len(now[n]) + 2 * PAGE)
                os.pwrite(rw, data, off)
                now[n].extend(bytes(max(0, off + len(data) - len(now[n]))))
                now[n][off:off + len(data)] = data
            elif op < 0.45:
                os.write(fds[n][os.O_WRONLY | os.O_APPEND], data)
                now[n] += data
            elif op < 0.5:
                os.pwrite(fds[n][os.O_WRONLY | os.O_DSYNC], data, 0)
                now[n][0:len(data)] = data
                synced[n] = bytes(now[n])
            elif op < 0.6:
                size = rng.randrange(0, len(now[n]) + PAGE)
                os.ftruncate(rw, size)
                now[n] = now[n][:size] + bytearray(max(0, size - len(now[n])))
            elif op < 0.7:
                os.fsync(rw)
                synced[n] = bytes(now[n])
            elif op < 0.75:  # a temp file renamed over it, synced first or not
                tmp = mnt / "d" / f"{n}.tmp"
                fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
                os.write(fd, data)
                sync = rng.random() < 0.5
                if sync:
                    os.fsync(fd)
                os.close(fd)
                close_all(n)
                os.rename(tmp, mnt / "d" / n)
                open_all(n)
                now[n], synced[n] = bytearray(data), data if sync else b""
            off = rng.randrange(0, len(now[n]) + 10)
            assert os.pread(rw, 2 * PAGE, off) == now[n][off:off + 2 * PAGE]
            assert os.stat(mnt / "d" / n).st_size == len(now[n])
        lost = fs.drop()
        assert lost["bytes"] > 0
        for n in names:
            with pytest.raises(OSError) as exc:
                os.pread(fds[n][os.O_RDWR], 1, 0)
            assert exc.value.errno == errno.EIO  # opened before the cut
            close_all(n)
            assert (mnt / "d" / n).read_bytes() == synced[n], n
            assert (tmp_path / "disk" / "d" / n).read_bytes() == synced[n], n


# ---- JetStream under a power cut ---------------------------------------------------------------


@dataclasses.dataclass
class Acked:
    """What the server acknowledged before the cut."""

    events: dict[int, str] = dataclasses.field(default_factory=dict)  # log seq -> event id
    facts: dict[int, str] = dataclasses.field(default_factory=dict)  # facts stream seq -> event id
    requests: set[str] = dataclasses.field(default_factory=set)  # request ids
    statuses: dict[str, bytes] = dataclasses.field(default_factory=dict)  # key -> the value kept last
    # key -> a newer value sent and not acknowledged at the cut: kept or not, either is right
    in_flight: dict[str, bytes] = dataclasses.field(default_factory=dict)
    rounds: int = 0

    def count(self) -> dict[str, int]:
        return {"events": len(self.events), "facts": len(self.facts), "requests": len(self.requests),
                "statuses": len(self.statuses)}


class PowerRig:
    """An `EmbeddedNats` whose JetStream store is a lazyfs mount; `cut` is the power cut."""

    def __init__(self, root: Path, sync_interval: str) -> None:
        self.fs = LazyMount(root / "disk", root / "store" / "jetstream")
        self.srv = EmbeddedNats(root / "store", sync_interval=sync_interval)

    def cut(self) -> dict[str, Any]:
        """SIGKILL the server's process group, then drop what was not synced: nothing syncs between."""
        proc = self.srv.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.srv.kill()  # forgets the process; the store is left as the kill left it
        return self.fs.drop()


@pytest.fixture
def rig_for(tmp_path: Path) -> Iterator[Any]:
    """`rig_for(sync_interval)`: a mounted rig with its server up; unmounted at the end whatever happens."""
    need_fuse()
    made: list[PowerRig] = []

    def make(sync_interval: str) -> PowerRig:
        rig = PowerRig(tmp_path / sync_interval, sync_interval)
        try:
            rig.fs.start()
        except RuntimeError as exc:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"cannot mount a FUSE filesystem here: {exc}")
        made.append(rig)
        rig.srv.start()
        return rig

    try:
        yield make
    finally:
        for rig in made:
            rig.srv.close()
            rig.fs.close()


def env(actor: str = "controller:power", **kw: Any) -> dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "ts": datetime.now(UTC), "actor": actor, **kw}


async def write_round(i: int, log: JetStreamEventLog, client: Client, kv: JetStreamStatusKV, acked: Acked,
                      last: list[int]) -> None:
    """One of each: a decision, a decision's batch, a fact, a request and its statuses (RECEIVED, then
    COMPLETED by compare-and-set). Each is recorded once its ack is in."""
    mk = f"power/m{i % 3}"
    ev = E.ReplicaEvictionRequested(**env(), model_key=mk, replica_id=i, node_id=NODE, reason=EvictionReason.ADMIN)
    r = await log.append([ev], last[0])
    acked.events[r.last_seq] = ev.event_id
    last[0] = r.last_seq
    cid = uuid.uuid4().hex
    batch = [E.CommandDecided(**env(), command_id=cid, model_key=mk, verb="deploy", fingerprint=cid),
             E.DeploymentRequested(**env(), command_id=cid, model_key=mk, op=DeploymentOp.DEPLOY, replicas=1,
                                   target_hot=1),
             E.ReplicaScheduled(**env(), command_id=cid, model_key=mk, replica_id=1000 + i, node_id=NODE,
                                gpu_indices=(0,), bytes_per_gpu=1)]
    r = await log.append(batch, last[0])
    acked.events.update(zip(range(r.first_seq, r.last_seq + 1), (e.event_id for e in batch), strict=True))
    last[0] = r.last_seq
    # Published as an agent does, to the facts stream (a controller's fact gate would admit it; none runs).
    fact = E.ReplicaLoaded(**env(f"agent:{NODE}"), model_key=mk, replica_id=i, node_id=NODE)
    ack = await log.js.publish(fact_inbox(E.event_subject(fact)), E.encode_event(fact), headers=E.event_headers(fact))
    assert ack.stream == FACTS_STREAM
    acked.facts[ack.seq] = fact.event_id
    job = await client.submit(mk, {"op": "echo", "i": i})
    await job.close()
    acked.requests.add(job.request_id)
    key = status_key(job.request_id)  # an open server: no user in the key
    received = StatusUpdate(request_id=key, status=RequestStatus.RECEIVED, ts=datetime.now(UTC), model_key=mk)
    rev = await kv.create(key, encode_status(received))
    acked.statuses[key] = encode_status(received)
    done = StatusUpdate(request_id=key, status=RequestStatus.COMPLETED, ts=datetime.now(UTC), model_key=mk,
                        result={"i": i})
    acked.in_flight[key] = encode_status(done)
    await kv.update(key, encode_status(done), rev)
    acked.statuses[key] = acked.in_flight.pop(key)
    acked.rounds += 1


async def write_until_cut(rig: PowerRig, *, settled: bool) -> tuple[Acked, dict[str, Any]]:
    """Write rounds without pause; cut the power while one is in flight, once ROUNDS are acknowledged.
    `settled`: the host writes everything back once the streams are made (they are old by the cut)."""
    acked = Acked()
    async with contextlib.AsyncExitStack() as stack:
        log = await JetStreamEventLog.open(rig.srv.url)  # the project's ensure makes every stream and bucket
        stack.push_async_callback(log.close)
        if settled:
            rig.fs.sync()
        kv = JetStreamStatusKV(await log.js.key_value(REQUEST_STATUS_BUCKET))
        client = await stack.enter_async_context(Client(rig.srv.url, timeout=5))
        last = [await log.last_seq()]

        async def writer() -> None:
            for i in range(10 * ROUNDS):
                await write_round(i, log, client, kv, acked, last)

        task = asyncio.create_task(writer())
        try:
            await until(lambda: acked.rounds >= ROUNDS or task.done(), timeout=60)
            if task.done():
                task.result()  # it failed before the cut
            dropped = rig.cut()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # what was in flight at the cut fails
            for nc in (client.log.nc, log.nc):  # closed, not drained: the server is gone
                # nats-py's close of a connection whose server died can raise on the dead socket
                with contextlib.suppress(OSError, TimeoutError, nats.errors.Error):
                    await asyncio.wait_for(nc.close(), 5)
    return acked, dropped


async def missing(url: str, acked: Acked) -> dict[str, list[Any]]:
    """The acknowledged items not there now, by kind (a stream lost entirely: all of its items)."""
    log = await JetStreamEventLog.open(url, ensure=False)
    try:
        stored: dict[int, str] = {}
        with contextlib.suppress(errs.NdifError):  # the log itself is gone
            async for seq, ev in log.read(1):
                stored[seq] = getattr(ev, "event_id", "")
        facts = []
        for seq, event_id in acked.facts.items():
            try:
                raw = await log.js.get_msg(FACTS_STREAM, seq, direct=True)
                ok = (raw.headers or {}).get(HDR_MSG_ID) == event_id
            except (nats.js.errors.NotFoundError, nats.errors.NoRespondersError, nats.errors.TimeoutError):
                ok = False
            if not ok:
                facts.append(seq)
        requests = JetStreamRequests(log.nc, log.js, ack_wait_s=30, fetch_batch=1)  # the dispatcher's reads
        found: set[str] = set()
        for subject in await requests.stored_subjects():
            seq = 0
            while (req := await requests.next_stored(subject, seq)) is not None:
                found.add(decode_request(req.data).request_id)
                seq = req.seq
        try:
            kv = JetStreamStatusKV(await log.js.key_value(REQUEST_STATUS_BUCKET))
            kept = {key: await kv.get(key) for key in acked.statuses}
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            kept = {}
        return {
            "events": sorted(seq for seq, event_id in acked.events.items() if stored.get(seq) != event_id),
            "facts": facts,
            "requests": sorted(acked.requests - found),
            "statuses": sorted(key for key, value in acked.statuses.items()
                               if (got := kept.get(key)) is None or got[0] not in (value, acked.in_flight.get(key))),
        }
    finally:
        await log.close()


# fresh: the cut comes before the host wrote anything back (the streams' own files are as new as
# the messages); settled: it wrote everything back once the streams were made.
STORES = pytest.mark.parametrize("settled", [False, True], ids=["fresh-store", "settled-store"])


@STORES
async def test_every_acknowledged_item_survives_a_power_cut(rig_for: Any, settled: bool) -> None:
    rig: PowerRig = rig_for(SYNC_ALWAYS)
    acked, dropped = await write_until_cut(rig, settled=settled)
    assert acked.rounds >= ROUNDS
    assert rig.fs.stats()["syncs"] > 0
    await rig.srv.astart()  # same store, same port
    lost = await missing(rig.srv.url, acked)
    assert not any(lost.values()), (f"acknowledged {acked.count()}, missing after the cut "
                                    f"{ {k: len(v) for k, v in lost.items()} }: {lost}; the cut dropped {dropped}")
    # The streams go on: the project's ensure finds the history (it refuses a lost one) and an append,
    # a fact, a request and a status are taken.
    async with await JetStreamEventLog.open(rig.srv.url) as log:
        last = await log.last_seq()
        assert last >= max(acked.events)
        ev = E.ReplicaEvictionRequested(**env(), model_key="power/m0", replica_id=0, node_id=NODE,
                                        reason=EvictionReason.ADMIN)
        r = await log.append([ev], last)
        assert (r.first_seq, r.last_seq, r.already_appended) == (last + 1, last + 1, False)
        assert [e.event_id for _, e in [p async for p in log.read(last + 1)]] == [ev.event_id]
        fact = E.ReplicaLoaded(**env(f"agent:{NODE}"), model_key="power/m0", replica_id=0, node_id=NODE)
        ack = await log.js.publish(fact_inbox(E.event_subject(fact)), E.encode_event(fact),
                                   headers=E.event_headers(fact))
        assert ack.stream == FACTS_STREAM and ack.seq > max(acked.facts)
        kv = JetStreamStatusKV(await log.js.key_value(REQUEST_STATUS_BUCKET))
        async with Client(rig.srv.url, timeout=5) as client:
            job = await client.submit("power/m0", {"op": "echo"})
            await job.close()
            status = StatusUpdate(request_id=job.request_id, status=RequestStatus.RECEIVED, ts=datetime.now(UTC))
            await kv.create(job.request_id, encode_status(status))
    again = Acked(requests={job.request_id}, statuses={job.request_id: encode_status(status)},
                  events={**acked.events, r.last_seq: ev.event_id})
    assert not any((await missing(rig.srv.url, again)).values())


@STORES
async def test_the_old_two_minute_sync_loses_acknowledged_items(rig_for: Any, settled: bool) -> None:
    """The same cut with the server's old default: acknowledged items are lost (the harness cuts).
    On a fresh store the streams themselves go (their definitions were never synced either)."""
    rig: PowerRig = rig_for(OLD_DEFAULT)
    acked, dropped = await write_until_cut(rig, settled=settled)
    assert dropped["bytes"] > 0, dropped
    await rig.srv.astart()
    lost = await missing(rig.srv.url, acked)
    assert any(lost.values()), f"nothing of {acked.count()} acknowledged was lost: the cut did not cut ({dropped})"
    # Every kind was written unsynced, so every kind loses some.
    assert all(lost.values()), {k: len(v) for k, v in lost.items()}
