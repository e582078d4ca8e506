"""The dispatcher <-> replica link (dataplane/serving/link.py) on a real nats-server and real Ray actors.

Answers over NATS; an answer too big for one message taken through Ray; no endpoint -> NoEndpoint at
once; a replica killed under a call -> RayActorError; an answer that never comes -> ReplyLost; the
same across accounts (the replica in a node agent's account, the dispatcher in the system's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import ray

from controlplane.ops.auth import ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.eventstore import connect
from dataplane.replica.endpoint import ReplicaEndpoint
from dataplane.replica.wire import Answer, Completed, encode_call
from dataplane.runtime.ray_adapter import RayCaller
from dataplane.serving.link import NoEndpoint, ReplicaLink, ReplyLost
from schemas.subjects import replica_call_subject

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0, max_concurrency=4)
class Host:
    """A replica-like actor: its `run_batch` answers over NATS through a `ReplicaEndpoint`."""

    def __init__(self, url: str, subject: str, max_answer_bytes: int, creds: Any = None) -> None:
        self.endpoint = ReplicaEndpoint(url, subject, self.run_batch, max_answer_bytes=max_answer_bytes,
                                        creds=creds).start()

    def run_batch(self, requests: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        out: list[Answer] = []
        for r in requests:
            time.sleep(r.get("sleep", 0))
            out.append(Completed(result={"echo": r["data"], "pad": "x" * r.get("pad", 0), "users": users},
                                 seconds=0.001))
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
    lk = await ReplicaLink(nc, _sender(nc, set()), RayCaller()).start()
    try:
        yield lk
    finally:
        await lk.stop()
        await nc.close()


def _sender(nc: Any, pending: set[asyncio.Task[None]]) -> Any:
    def send(subject: str, body: bytes, reply: str, headers: dict[str, str] | None) -> None:
        t = asyncio.create_task(nc.publish(subject, body, reply=reply, headers=headers))
        pending.add(t)
        t.add_done_callback(pending.discard)

    return send


async def test_answers_over_nats_large_ones_through_ray_and_no_endpoint_at_once(
        link: ReplicaLink, nats_server: EmbeddedNats) -> None:
    host = Host.remote(nats_server.url, "ndif.run.t1.0", 300)  # type: ignore[attr-defined]
    assert await host.ready.remote()
    key = ("t1", 0)
    small = await link.call(key, "ndif.run.t1.0", host, encode_call([{"data": 1}, {"data": 2}], ["ann", "bo"]))
    assert all(isinstance(a, Completed) for a in small) and [a.result["echo"] for a in small] == [1, 2]  # type: ignore[union-attr]
    assert small[0].result["users"] == ["ann", "bo"]  # type: ignore[union-attr]  # whose each is, for the turns
    (big,) = await link.call(key, "ndif.run.t1.0", host, encode_call([{"data": 3, "pad": 5000}]))
    assert isinstance(big, Completed)
    assert big.result["echo"] == 3 and len(big.result["pad"]) == 5000  # parked in the actor, taken via Ray
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


def _echo(requests: list[dict[str, Any]], users: list[str] | None = None) -> list[Answer]:
    return [Completed(result={"echo": r["data"], "pad": "x" * r.get("pad", 0)}, seconds=0.001) for r in requests]


class _EndpointCaller:
    """A `ReplicaCaller` whose handles are in-process endpoints; it records what the link asks of it."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def lookup(self, model_key: str, replica_id: int) -> Any:
        return None

    async def run_batch(self, handle: ReplicaEndpoint, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        self.asked.append("run_batch")
        return _echo(payloads)

    async def take_answer(self, handle: ReplicaEndpoint, reply: str) -> list[Answer] | None:
        self.asked.append("take_answer")
        return handle.take_answer(reply)

    async def calls_active(self, handle: ReplicaEndpoint, replies: list[str]) -> list[bool]:
        self.asked.append("calls_active")
        return handle.calls_active(replies)

    def gone(self, exc: BaseException) -> bool:
        return False


async def test_the_dispatchers_link_takes_parked_answers_through_the_dispatchers_caller(
        nats_server: EmbeddedNats, event_log: Any) -> None:
    """A dispatcher given a caller hands that caller to its replica link (no Ray here: the endpoint
    runs in this process and the caller reaches it directly)."""
    from dataplane.serving.dispatcher import Dispatcher

    ep = ReplicaEndpoint(nats_server.url, "ndif.run.t3.0", _echo, max_answer_bytes=300).start()
    caller = _EndpointCaller()
    try:
        assert await asyncio.to_thread(ep.ready, 10)
        async with Dispatcher.from_url(nats_server.url, name="dispatcher:link", caller=caller) as disp:
            assert disp.link is not None
            (big,) = await disp.link.call(("t3", 0), "ndif.run.t3.0", ep, encode_call([{"data": 5, "pad": 5000}]))
            assert isinstance(big, Completed) and big.result["echo"] == 5 and len(big.result["pad"]) == 5000
            assert caller.asked == ["take_answer"]  # parked, and taken through the dispatcher's caller
    finally:
        ep.close()


async def test_across_accounts_a_call_is_known_by_its_id(local_ray: str, tmp_path: Path) -> None:
    """With users in accounts (controlplane/ops/auth.py) the dispatcher's call crosses into the node
    agent's account, where the replica sees a reply subject the server made for the way back: a call
    still running and a parked answer are found by the call's id (a header), not by that subject."""
    auth = ensure_local(["node-x"], clients=["alice"], home=tmp_path / "home")
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        nc = await connect(srv.url, creds=auth.role("dispatcher"))
        lk = await ReplicaLink(nc, _sender(nc, set()), RayCaller()).start()
        subject = replica_call_subject("m", 0, "node-x")
        host = Host.remote(srv.url, subject, 300, auth.role("agent:node-x"))  # type: ignore[attr-defined]
        try:
            assert await host.ready.remote()
            key = ("m", 0)
            slow = await asyncio.wait_for(lk.call(key, subject, host, encode_call([{"data": 1, "sleep": 3.5}])), 20)
            assert isinstance(slow[0], Completed) and slow[0].result["echo"] == 1  # checked active over 3 rounds, never taken for lost
            big = await asyncio.wait_for(lk.call(key, subject, host, encode_call([{"data": 2, "pad": 5000}])), 20)
            assert isinstance(big[0], Completed) and big[0].result["echo"] == 2 and len(big[0].result["pad"]) == 5000  # parked, taken through Ray by its id
        finally:
            ray.kill(host)
            await lk.stop()
            await nc.close()
