"""The status writer keeps a QUEUED status in KV only once its request has waited, and paces those
writes: a flood's queued statuses must not cost one stored write each as the flood is taken in (every
request behind it in the stream, another user's too, would wait for them), yet a request that waits
is found QUEUED by a client that reconnects."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from dataplane.serving.dispatcher import statuses as S
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.memory import MemoryResults, MemoryStatusKV
from dataplane.serving.processor import Pending
from schemas.requests import Request
from schemas.status import RequestStatus
from schemas.subjects import status_key
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)
R = RequestStatus


def pending(i: int) -> Pending:
    req = Request(request_id=f"r{i}", model_key="m", payload={}, submitted_at=datetime.now(UTC), user="u")
    return Pending(req, None)


def writer() -> tuple[S.StatusWriter, MemoryStatusKV, list[str]]:
    published: list[str] = []

    async def publish(subject: str, data: bytes, reply: str = "", headers: Any = None) -> None:
        published.append(subject)

    kv = MemoryStatusKV()
    return S.StatusWriter(publish, kv, MemoryResults(), Background()), kv, published  # type: ignore[arg-type]


def kept(kv: MemoryStatusKV, p: Pending) -> str | None:
    got = kv.entries.get(status_key(p.req.request_id, p.req.user))
    return None if got is None else str(msgspec.json.decode(got[0])["status"])


async def test_queued_statuses_are_published_at_once_kept_after_the_wait_and_paced(monkeypatch: Any) -> None:
    monkeypatch.setattr(S, "QUEUED_KV_AFTER_S", 0.3)
    monkeypatch.setattr(S, "QUEUED_KV_PER_S", 200)  # 10 per 50 ms slice
    w, kv, published = writer()
    ps = [pending(i) for i in range(60)]
    for i, p in enumerate(ps):
        w.status(p, R.QUEUED, queue_position=i)
    await asyncio.sleep(0.05)
    assert len(published) == 60  # every client hears of its position at once
    assert not kv.entries  # nothing stored as the flood comes in
    # One of them runs (and ends) within the wait: its QUEUED is never written.
    w.status(ps[0], R.RUNNING)
    assert await w.finish(ps[0], R.COMPLETED, result=1)
    assert kept(kv, ps[0]) == "COMPLETED"
    await asyncio.sleep(0.3)  # the others waited long enough: kept, at most 10 per 50 ms
    first = len(kv.entries) - 1
    assert 1 <= first <= 20
    await asyncio.sleep(0.5)
    assert all(kept(kv, p) == "QUEUED" for p in ps[1:])
    assert kept(kv, ps[0]) == "COMPLETED"


async def test_a_terminal_status_is_kept_at_once_over_a_waiting_queued_one() -> None:
    w, kv, _ = writer()
    p = pending(1)
    w.status(p, R.QUEUED, queue_position=3)
    assert await w.finish(p, R.ERROR, error="X", message="y")
    assert kept(kv, p) == "ERROR"
    await asyncio.sleep(S._PACE_S * 3)
    assert kept(kv, p) == "ERROR"  # the superseded QUEUED never lands after it


class BehindKV(MemoryStatusKV):
    """A replicated bucket whose reads are answered, for a while, by a copy that is behind: the
    revision a read gives is an older one than the key holds."""

    def __init__(self, behind_s: float) -> None:
        super().__init__()
        self.until = asyncio.get_running_loop().time() + behind_s
        self.stale: dict[str, tuple[bytes, int]] = {}

    async def get(self, key: str) -> tuple[bytes, int] | None:
        if asyncio.get_running_loop().time() < self.until and key in self.stale:
            return self.stale[key]
        return await super().get(key)


async def test_a_read_behind_the_write_is_waited_out_and_an_unkept_terminal_status_is_never_acked(
        monkeypatch: Any) -> None:
    w, _, _ = writer()
    kv = w.kv = BehindKV(behind_s=0.4)
    p = pending(7)
    key = status_key(p.req.request_id, p.req.user)
    # Another dispatcher kept RUNNING twice; the copy that answers reads still has the first.
    first = S.encode_status(w._update(p, R.RUNNING))
    kv.stale[key] = (first, kv._put(key, first))
    kv._put(key, S.encode_status(w._update(p, R.RUNNING)))
    assert await w.finish(p, R.COMPLETED, result=1)  # waited for the copy to catch up
    assert kept(kv, p) == "COMPLETED"
    # A key that never stops moving: the terminal status is not kept, and finish says so (the
    # request is then not acked, so it is delivered again) rather than answering as if kept.
    q = pending(8)
    qkey = status_key(q.req.request_id, q.req.user)
    kv.until = asyncio.get_running_loop().time() + 60
    kv.stale[qkey] = (first, kv._put(qkey, first))
    kv._put(qkey, first)
    sleep = asyncio.sleep

    async def fast(_: float) -> None:
        await sleep(0)

    monkeypatch.setattr(asyncio, "sleep", fast)  # the waits between tries, not their number, are cut
    with pytest.raises(S.InfrastructureError, match="delivered again"):
        await w.finish(q, R.COMPLETED, result=1)


async def test_flush_publishes_now_and_keeps_the_order_with_the_outbox_task() -> None:
    """`flush` sends what waits from the calling task (a replica call leaves a loop turn sooner);
    with a publish that yields (a slow connection) the outbox task and a flush never interleave."""
    sent: list[str] = []

    async def slow_publish(subject: str, data: bytes, reply: str = "", headers: Any = None) -> None:
        await asyncio.sleep(0.001)
        sent.append(subject)

    w = S.StatusWriter(slow_publish, MemoryStatusKV(), MemoryResults(), Background())  # type: ignore[arg-type]
    for i in range(3):
        w.send(f"s.{i}", b"")
    flushing = asyncio.create_task(w.flush())
    await asyncio.sleep(0)  # the flush is under way (inside a publish); more is sent meanwhile
    for i in range(3, 6):
        w.send(f"s.{i}", b"")
    await w.flush()  # a drain is under way: it takes these too, in order
    await flushing
    # The drain under way may be the outbox task's (it can start first): wait for it, not a fixed time.
    await until(lambda: len(sent) >= 6, timeout=10)
    await asyncio.sleep(0.01)  # nothing more, and nothing twice
    assert sent == [f"s.{i}" for i in range(6)]

    fast: list[str] = []

    async def publish(subject: str, data: bytes, reply: str = "", headers: Any = None) -> None:
        fast.append(subject)

    w = S.StatusWriter(publish, MemoryStatusKV(), MemoryResults(), Background())  # type: ignore[arg-type]
    w.send("call", b"", "reply")
    await w.flush()
    assert fast == ["call"]  # sent before the outbox task ran
    await asyncio.sleep(0)
    assert fast == ["call"]  # and only once


async def test_a_drain_cancelled_or_failing_midway_loses_nothing_after_it() -> None:
    """The delivering task's flush can be cancelled (its subscription stops) or meet a publish that
    fails: the messages behind it are still sent, in order, by the outbox task; a failing publish
    loses only its own message and never raises into the request that flushed."""
    sent: list[str] = []
    gate = asyncio.Event()

    async def publish(subject: str, data: bytes, reply: str = "", headers: Any = None) -> None:
        if subject == "boom":
            raise ConnectionError("closed")
        if subject == "c.1" and not gate.is_set():
            sent.append(subject)  # queued by the connection before it waits
            await gate.wait()
            return
        sent.append(subject)

    w = S.StatusWriter(publish, MemoryStatusKV(), MemoryResults(), Background())  # type: ignore[arg-type]
    for name in ("c.1", "boom", "c.2", "c.3"):
        w.send(name, b"")
    flushing = asyncio.create_task(w.flush())
    await asyncio.sleep(0.01)  # inside the publish of c.1
    w.send("late", b"")
    flushing.cancel()
    await asyncio.gather(flushing, return_exceptions=True)
    gate.set()
    async with asyncio.timeout(5):
        while len(sent) < 4:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert sent == ["c.1", "c.2", "c.3", "late"], sent
    w.send("boom", b"")
    w.send("after", b"")
    await w.flush()  # the failure is logged, not raised
    assert sent[-1] == "after"
