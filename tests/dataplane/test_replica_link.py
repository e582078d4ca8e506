"""The dispatcher <-> replica link (dataplane/serving/link.py) on a real nats-server and real Ray actors.

Answers over NATS; an answer too big for one message taken through Ray; no endpoint -> NoEndpoint at
once; a replica killed under a call -> RayActorError; an answer that never comes -> ReplyLost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import ray

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.eventstore import connect
from dataplane.replica.endpoint import ReplicaEndpoint, encode_call
from dataplane.serving.link import NoEndpoint, ReplicaLink, ReplyLost

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0, max_concurrency=4)
class Host:
    """A replica-like actor: its `run_batch` answers over NATS through a `ReplicaEndpoint`."""

    def __init__(self, url: str, subject: str, max_answer_bytes: int) -> None:
        self.endpoint = ReplicaEndpoint(url, subject, self.run_batch, max_answer_bytes=max_answer_bytes).start()

    def run_batch(self, requests: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        out = []
        for r in requests:
            time.sleep(r.get("sleep", 0))
            out.append((0, {"echo": r["data"], "pad": "x" * r.get("pad", 0)}, 0.001))
        return out

    def ready(self) -> bool:
        return self.endpoint.ready(10)

    def calls_active(self, replies: list[str]) -> list[bool]:
        return self.endpoint.calls_active(replies)

    def take_answer(self, reply: str) -> Any:
        return self.endpoint.take_answer(reply)


@pytest_asyncio.fixture
async def link(nats_server: EmbeddedNats, local_ray: str) -> AsyncIterator[ReplicaLink]:
    nc = await connect(nats_server.url)
    pending: set[asyncio.Task[None]] = set()

    def send(subject: str, body: bytes, reply: str) -> None:
        t = asyncio.create_task(nc.publish(subject, body, reply=reply))
        pending.add(t)
        t.add_done_callback(pending.discard)

    lk = await ReplicaLink(nc, send).start()
    try:
        yield lk
    finally:
        await lk.stop()
        await nc.close()


async def test_answers_over_nats_large_ones_through_ray_and_no_endpoint_at_once(
        link: ReplicaLink, nats_server: EmbeddedNats) -> None:
    host = Host.remote(nats_server.url, "ndif.run.t1.0", 300)  # type: ignore[attr-defined]
    assert await host.ready.remote()
    key = ("t1", 0)
    small = await link.call(key, "ndif.run.t1.0", host, encode_call([{"data": 1}, {"data": 2}]))
    assert [a[1]["echo"] for a in small] == [1, 2] and small[0][0] == 0
    big = await link.call(key, "ndif.run.t1.0", host, encode_call([{"data": 3, "pad": 5000}]))
    assert big[0][1]["echo"] == 3 and len(big[0][1]["pad"]) == 5000  # parked in the actor, taken via Ray
    t0 = time.monotonic()
    with pytest.raises(NoEndpoint):
        await link.call(("t1", 9), "ndif.run.t1.9", host, encode_call([{"data": 4}]))
    assert time.monotonic() - t0 < 1.0  # the server's "no responders", not a timeout
    assert link.usable(key, 10)
    link.endpoint_absent(key)
    assert not link.usable(key, 10)
    ray.kill(host)


async def test_a_replica_killed_under_a_call_and_a_lost_answer_are_found(
        link: ReplicaLink, nats_server: EmbeddedNats) -> None:
    host = Host.remote(nats_server.url, "ndif.run.t2.0", 10**6)  # type: ignore[attr-defined]
    assert await host.ready.remote()
    slow = link.call(("t2", 0), "ndif.run.t2.0", host, encode_call([{"data": 1, "sleep": 30}]))
    await asyncio.sleep(0.3)
    ray.kill(host)
    t0 = time.monotonic()
    with pytest.raises((ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)):
        await asyncio.wait_for(slow, 10)
    assert time.monotonic() - t0 < 8  # found by the 1 s check, not the 30 s run ending

    # Someone takes the call on the replica's subject and never answers; the (live) replica does not
    # know it: after two checks the answer counts as lost.
    alive = Host.remote(nats_server.url, "ndif.run.t2.other", 10**6)  # type: ignore[attr-defined]
    assert await alive.ready.remote()
    nc = await connect(nats_server.url)
    try:
        async def swallow(_msg: Any) -> None:
            return None

        await nc.subscribe("ndif.run.t2.1", cb=swallow)
        await nc.flush()
        lost = link.call(("t2", 1), "ndif.run.t2.1", alive, encode_call([{"data": 2}]))
        with pytest.raises(ReplyLost):
            await asyncio.wait_for(lost, 10)
    finally:
        await nc.close()
        ray.kill(alive)
