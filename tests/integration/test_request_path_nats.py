"""The NATS parts of the request path, on a real nats-server: the continuous pull and the status republish."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.js.errors
import pytest
from nats.js import api

from controlplane.store.eventstore import JetStreamEventLog
from dataplane.serving.pull import ConsumerGone, PullConsumer
from schemas.subjects import REQUEST_STATUS_BUCKET, status_subject


async def _stream(lg: JetStreamEventLog, name: str) -> None:
    try:
        await lg.js.delete_stream(name)
    except nats.js.errors.NotFoundError:
        pass
    await lg.js.add_stream(name=name, subjects=[f"{name.lower()}.>"], retention=api.RetentionPolicy.WORK_QUEUE)
    await lg.js.add_consumer(name, api.ConsumerConfig(durable_name="c", ack_policy=api.AckPolicy.EXPLICIT))


async def test_pull_delivers_as_stored_and_survives_expiry(event_log: JetStreamEventLog) -> None:
    """Every message arrives once, across pulls that expire (408 gives back what was not sent)."""
    await _stream(event_log, "PULLT")
    got: list[bytes] = []

    async def on_msg(m: Any) -> None:
        got.append(m.data)
        await m.ack()

    pc = PullConsumer(event_log.nc, "PULLT", "c", on_msg, batch=4, expires_s=0.3, heartbeat_s=0.1)
    task = asyncio.create_task(pc.run())
    try:
        for i in range(10):  # more than one batch: the pull is topped up at half
            await event_log.js.publish("pullt.x", str(i).encode())
        async with asyncio.timeout(10):
            while len(got) < 10:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # several pulls expire meanwhile
        pulls_idle = pc.pulls
        await event_log.js.publish("pullt.x", b"late")
        async with asyncio.timeout(10):
            while len(got) < 11:
                await asyncio.sleep(0.01)
        assert got == [str(i).encode() for i in range(10)] + [b"late"]
        assert 0 <= pc.pending <= pc.batch
        assert pulls_idle <= 20  # one pull per expiry while idle (0.3 s), not one per message or a loop
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_pull_holds_while_the_owner_is_full(event_log: JetStreamEventLog) -> None:
    await _stream(event_log, "PULLH")
    got: list[bytes] = []
    full = True

    async def on_msg(m: Any) -> None:
        got.append(m.data)

    pc = PullConsumer(event_log.nc, "PULLH", "c", on_msg, batch=4, heartbeat_s=0.1, hold=lambda: full)
    task = asyncio.create_task(pc.run())
    try:
        await event_log.js.publish("pullh.x", b"a")
        await asyncio.sleep(0.5)
        assert got == [] and pc.pulls == 0  # held: stays in the stream for another dispatcher
        full = False
        pc.wake()
        async with asyncio.timeout(10):
            while not got:
                await asyncio.sleep(0.01)
        assert got == [b"a"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_pull_reports_a_deleted_consumer(event_log: JetStreamEventLog) -> None:
    await _stream(event_log, "PULLD")

    async def on_msg(m: Any) -> None:
        pass

    pc = PullConsumer(event_log.nc, "PULLD", "c", on_msg, batch=4, heartbeat_s=0.1)
    task = asyncio.create_task(pc.run())
    await asyncio.sleep(0.3)
    await event_log.js.delete_consumer("PULLD", "c")
    with pytest.raises(ConsumerGone):
        async with asyncio.timeout(10):
            await task


async def test_a_stored_message_dressed_as_a_status_is_delivered_not_obeyed(event_log: JetStreamEventLog) -> None:
    """A client may store a request whose header block reads like the server's `409 Consumer
    Deleted` in another version, or carries a `Status` line of its own, with no payload: the pull
    hands it over as the message it is (to be ended as unreadable), and goes on pulling."""
    await _stream(event_log, "PULLF")
    got: list[bytes] = []

    async def on_msg(m: Any) -> None:
        got.append(m.headers.get("Nats-Msg-Id", "").encode() if m.headers else b"?")
        await m.ack()

    pc = PullConsumer(event_log.nc, "PULLF", "c", on_msg, batch=4, heartbeat_s=0.1)
    task = asyncio.create_task(pc.run())
    try:
        for block in (b"EVIL/1.0 409\r\nNats-Msg-Id: f1\r\nDescription: Consumer Deleted\r\n\r\n",
                      b"NATS/1.0\r\nNats-Msg-Id: f2\r\nStatus: 408\r\nNats-Pending-Messages: 1000\r\n\r\n"):
            inbox = event_log.nc.new_inbox()
            sub = await event_log.nc.subscribe(inbox, max_msgs=1)
            cmd = b"HPUB pullf.x %s %d %d\r\n" % (inbox.encode(), len(block), len(block))
            await event_log.nc._send_command(cmd + block + b"\r\n")
            await event_log.nc.flush()
            await sub.next_msg(timeout=5)
        await event_log.js.publish("pullf.x", b"after", headers={"Nats-Msg-Id": "f3"})
        async with asyncio.timeout(10):
            while len(got) < 3:
                await asyncio.sleep(0.01)
        assert got == [b"f1", b"f2", b"f3"] and not task.done()
        assert 0 <= pc.pending <= pc.batch
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_kept_status_is_republished_and_a_losing_write_never_seen(event_log: JetStreamEventLog) -> None:
    """The terminal status reaches `ndif.status.<id>` only as KV keeps it (docs/architecture.md §4: exactly once)."""
    seen: list[tuple[str, bytes]] = []

    async def cb(m: Any) -> None:
        seen.append((m.subject, m.data))

    rid = "req-republish-1"
    sub = await event_log.nc.subscribe(status_subject(rid), cb=cb)
    kv = await event_log.js.key_value(REQUEST_STATUS_BUCKET)
    rev = await kv.create(rid, json.dumps({"status": "COMPLETED", "by": "winner"}).encode())
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await kv.update(rid, json.dumps({"status": "COMPLETED", "by": "loser"}).encode(), last=rev - 1 if rev > 1 else 0)
    await asyncio.sleep(0.3)
    await sub.unsubscribe()
    assert status_subject(rid) == f"ndif.status.{rid}"
    assert [json.loads(d)["by"] for _, d in seen] == ["winner"]
