"""One contract, every implementation of the serving ports (dataplane/serving/ports.py): in memory
(dataplane/serving/memory.py) and on JetStream against a real nats-server (dataplane/serving/jetstream.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from dataplane.serving.jetstream import JetStreamRequests, JetStreamResults, JetStreamStatusKV
from dataplane.serving.memory import MemoryServing
from dataplane.serving.ports import Delivery, RequestStream, ResultStores, RevisionMoved, StatusKV
from schemas.commands import CommandResult
from schemas.subjects import (
    REQUEST_STATUS_BUCKET,
    RESULTS_BUCKET,
    model_token,
    request_consumer,
    request_partition,
    stored_request_subject,
)
from tests.conftest import fresh_event_log
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


@dataclass
class Impl:
    requests: RequestStream
    statuses: StatusKV
    results: ResultStores
    publish_request: Callable[[str, bytes], Awaitable[None]]  # as a client publishes one
    read_result: Callable[[str, str], Awaitable[bytes]]


async def _no_deploy(model_key: str, replicas: int) -> CommandResult:
    raise AssertionError("not here")


@pytest_asyncio.fixture(params=["memory", "jetstream"])
async def impl(request: pytest.FixtureRequest, nats_server: Any) -> AsyncIterator[Impl]:
    if request.param == "memory":
        mem = MemoryServing(_no_deploy)

        async def put(subject: str, data: bytes) -> None:
            await mem.requests.put(subject, data)

        async def read(user: str, name: str) -> bytes:
            return mem.results.kept[(user, name)]

        yield Impl(mem.requests, mem.statuses, mem.results, put, read)
        return
    log = await fresh_event_log(nats_server.url)
    js = log.js
    results = JetStreamResults(js, await js.object_store(RESULTS_BUCKET), replicas=1)

    async def publish(subject: str, data: bytes) -> None:
        await js.publish(subject, data)

    async def read_js(user: str, name: str) -> bytes:
        got = await (await results.store(user)).get(name)
        return bytes(got.data or b"")

    try:
        yield Impl(JetStreamRequests(log.nc, js, ack_wait_s=5.0, fetch_batch=8),
                   JetStreamStatusKV(await js.key_value(REQUEST_STATUS_BUCKET)), results, publish, read_js)
    finally:
        await log.close()


def _key() -> str:
    return f"k-{uuid.uuid4().hex[:10]}"


async def test_status_kv_is_compare_and_set(impl: Impl) -> None:
    key = _key()
    assert await impl.statuses.get(key) is None
    rev = await impl.statuses.create(key, b"QUEUED")
    assert await impl.statuses.get(key) == (b"QUEUED", rev)
    with pytest.raises(RevisionMoved):
        await impl.statuses.create(key, b"again")
    rev2 = await impl.statuses.update(key, b"RUNNING", rev)
    assert rev2 > rev and await impl.statuses.get(key) == (b"RUNNING", rev2)
    with pytest.raises(RevisionMoved):
        await impl.statuses.update(key, b"stale", rev)
    assert await impl.statuses.get(key) == (b"RUNNING", rev2)


async def test_results_are_kept_per_user(impl: Impl) -> None:
    name = f"{_key()}.json"
    await impl.results.put("", name, b"shared")
    await impl.results.put("bob", name, b"bobs")
    assert await impl.read_result("", name) == b"shared" and await impl.read_result("bob", name) == b"bobs"


async def test_stored_requests_are_read_by_subject_and_deleted(impl: Impl) -> None:
    tok = model_token(f"m-{uuid.uuid4().hex[:6]}")
    seen: list[str] = []

    async def on_subject(subject: str) -> None:
        seen.append(subject)

    stop = await impl.requests.watch(on_subject)
    try:
        await impl.publish_request(f"ndif.req.{tok}.alice", b"a1")
        await impl.publish_request(f"ndif.req.{tok}", b"open")
        await impl.publish_request(f"ndif.req.{tok}.alice", b"a2")
        await until(lambda: len(seen) == 3)
    finally:
        await stop()
    assert seen == [f"ndif.req.{tok}.alice", f"ndif.req.{tok}", f"ndif.req.{tok}.alice"]
    # A user's request is stored under the user's partition (the stream's subject transform).
    alice = f"ndif.req.{tok}.alice.{request_partition('alice')}"
    assert alice == stored_request_subject(f"ndif.req.{tok}.alice")
    assert set(await impl.requests.stored_subjects()) >= {alice, f"ndif.req.{tok}"}
    first = await impl.requests.next_stored(f"ndif.req.{tok}.>", 0)
    assert first is not None and (first.subject, first.data) == (alice, b"a1")
    second = await impl.requests.next_stored(f"ndif.req.{tok}.>", first.seq)
    assert second is not None and second.data == b"a2" and second.seq > first.seq
    assert await impl.requests.next_stored(f"ndif.req.{tok}.>", second.seq) is None
    await impl.requests.delete(first.seq)
    await impl.requests.delete(first.seq)  # gone already: nothing
    again = await impl.requests.next_stored(f"ndif.req.{tok}.>", 0)
    assert again is not None and again.seq == second.seq


async def test_a_models_consumer_delivers_its_requests_and_an_ack_takes_one_out(impl: Impl) -> None:
    tok = model_token(f"m-{uuid.uuid4().hex[:6]}")
    other = model_token(f"m-{uuid.uuid4().hex[:6]}")
    for subject, body in ((f"ndif.req.{tok}.alice", b"1"), (f"ndif.req.{other}", b"x"), (f"ndif.req.{tok}", b"2")):
        await impl.publish_request(subject, body)
    got: list[tuple[Delivery, int]] = []

    async def on_delivery(m: Delivery, attempt: int) -> None:
        got.append((m, attempt))

    task = asyncio.create_task(impl.requests.consume(tok, on_delivery, hold=lambda _k: False))
    try:
        await until(lambda: len(got) == 2, timeout=10)
        assert sorted((m.data, a) for m, a in got) == [(b"1", 1), (b"2", 1)]  # its own only, first delivery
        assert tok in await impl.requests.consumer_tokens()
        for m, _ in got:
            await m.ack()
        async with asyncio.timeout(10):
            while await impl.requests.next_stored(f"ndif.req.{tok}.>", 0) or \
                    await impl.requests.next_stored(f"ndif.req.{tok}", 0):
                await asyncio.sleep(0.02)
        assert await impl.requests.next_stored(f"ndif.req.{other}", 0) is not None  # another model's: still there
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert await impl.requests.delete_consumer(tok) is True
    assert await impl.requests.delete_consumer(tok) is False
    assert request_consumer(tok) and tok not in await impl.requests.consumer_tokens()


async def test_a_users_request_is_not_read_after_a_burst_stored_before_it_by_another_partition(impl: Impl) -> None:
    """A request stored behind another user's burst reaches the dispatcher before the burst has been
    read (each user partition has a consumer of its own); each user's own requests come in order."""
    tok = model_token(f"m-{uuid.uuid4().hex[:6]}")
    heavy, light = "heavy", next(u for u in (f"u{i}" for i in range(100))
                                 if request_partition(u) != request_partition("heavy"))
    burst = 400
    for i in range(burst):
        await impl.publish_request(f"ndif.req.{tok}.{heavy}", b"h%d" % i)
    await impl.publish_request(f"ndif.req.{tok}.{light}", b"light")
    got: list[bytes] = []

    async def on_delivery(m: Delivery, attempt: int) -> None:
        got.append(m.data)
        await m.ack()

    task = asyncio.create_task(impl.requests.consume(tok, on_delivery, hold=lambda _k: False))
    try:
        await until(lambda: len(got) == burst + 1, timeout=30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await impl.requests.delete_consumer(tok)
    # One pull of the burst's partition (8 here) may come first; never the whole burst.
    assert got.index(b"light") <= burst // 4, got.index(b"light")
    assert [g for g in got if g != b"light"] == [b"h%d" % i for i in range(burst)]


async def test_the_stream_stores_each_user_under_the_partition_the_code_computes(impl: Impl) -> None:
    """`request_partition` is what nats-server's `partition()` transform gives (FNV-1a, mod 16): the
    docs and `nats` CLI users find a user's consumer by it."""
    tok = model_token(f"m-{uuid.uuid4().hex[:6]}")
    users = ["alice", "bob", "light", "heavy", "u_1", "team-7", "X" * 40]
    for u in users:
        await impl.publish_request(f"ndif.req.{tok}.{u}", b"x")
    stored = set(await impl.requests.stored_subjects())
    assert {f"ndif.req.{tok}.{u}.{request_partition(u)}" for u in users} <= stored


async def test_a_held_partition_is_not_read_while_the_others_are(impl: Impl) -> None:
    """`hold(k)` stops one user partition's consumer, not the model's: a dispatcher full of two floods
    still reads a third user's requests."""
    tok = model_token(f"m-{uuid.uuid4().hex[:6]}")
    heavy, light = "heavy", next(u for u in (f"u{i}" for i in range(100))
                                 if request_partition(u) != request_partition("heavy"))
    for i in range(20):
        await impl.publish_request(f"ndif.req.{tok}.{heavy}", b"h%d" % i)
    await impl.publish_request(f"ndif.req.{tok}.{light}", b"light")
    got: list[bytes] = []
    held = {request_partition(heavy)}

    async def on_delivery(m: Delivery, attempt: int) -> None:
        got.append(m.data)
        await m.ack()

    task = asyncio.create_task(impl.requests.consume(tok, on_delivery, hold=lambda k: k in held))
    try:
        await until(lambda: b"light" in got, timeout=10)
        await asyncio.sleep(0.3)
        assert got == [b"light"], got  # the held partition's requests were not read
        held.clear()
        await until(lambda: len(got) == 21, timeout=20)  # read once the hold ends (the next pull, heartbeat)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await impl.requests.delete_consumer(tok)
