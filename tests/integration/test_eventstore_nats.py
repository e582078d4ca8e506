"""JetStream-specific behaviour of the event store, against a real nats-server (no mocks)."""

from __future__ import annotations

import asyncio
import json

import pytest
from structlog.testing import capture_logs

from controlplane.core.projections import ClusterState, fold
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.eventstore import JetStreamEventLog
from schemas.errors import ConflictError
from schemas.subjects import EVENTS_STREAM
from tests.contract.test_eventlog_contract import collect, loads
from tests.strategies import node_joined, scripted_history


async def test_two_writers_at_the_same_expected_seq_exactly_one_wins(nats_server, event_log):
    other = await JetStreamEventLog.open(nats_server.url)
    try:
        for round_, size in enumerate((1, 3, 1, 4)):
            base = await event_log.last_seq()
            a, b = loads(size, 100 * round_), loads(size, 100 * round_ + 50)
            results = await asyncio.gather(event_log.append(a, base), other.append(b, base),
                                           return_exceptions=True)
            wins = [r for r in results if not isinstance(r, BaseException)]
            losses = [r for r in results if isinstance(r, ConflictError)]
            assert len(wins) == 1 and len(losses) == 1, results
            assert losses[0].actual_last_seq == base + size
            assert await event_log.last_seq() == base + size
    finally:
        await other.close()


async def test_a_losing_batch_leaves_no_trace(event_log):
    await event_log.append(loads(3), 0)
    with pytest.raises(ConflictError):
        await event_log.append(loads(50, 10), 1)
    stored = await collect(event_log.read())
    assert [e.replica_id for _, e in stored] == [0, 1, 2]


async def test_events_read_well_with_plain_nats_py(event_log):
    ev = node_joined("gpu-01.example.org")
    await event_log.append([ev, *loads(1)], 0)
    raw = await event_log.js.get_msg(EVENTS_STREAM, 1)  # plain nats-py, no project code
    body = json.loads(raw.data)
    assert isinstance(body, dict) and body["type"] == "NodeJoined" and body["node_id"] == "gpu-01.example.org"
    assert raw.headers["Nats-Msg-Id"] == ev.event_id
    assert raw.headers["Ndif-Event"] == "NodeJoined" and raw.headers["Ndif-Schema"] == "1"
    assert raw.subject.startswith("ndif.evt.node.gpu-01_example_org-")
    cfg = (await event_log.js.stream_info(EVENTS_STREAM)).config
    assert cfg.deny_delete and cfg.deny_purge and cfg.allow_atomic


async def test_ensure_is_idempotent(event_log):
    with capture_logs() as logs:
        await event_log.ensure()
        await event_log.ensure()
    assert not [entry for entry in logs if entry["event"] in ("stream_updated", "stream_created")]


async def test_malformed_and_newer_bodies_are_skipped_and_kept_as_data(event_log):
    await event_log.append(loads(1), 0)
    await event_log.js.publish("ndif.evt.node.junk", b"{not json")
    await event_log.js.publish("ndif.evt.node.future", b'{"type": "ReplicaTeleported", "event_id": "z"}')
    await event_log.append(loads(1, 1), 3)
    with capture_logs() as logs:
        state = fold(await collect(event_log.read()), ClusterState())
    assert state.seq == 4 and state.skipped == 2
    assert not logs  # the fold is silent: the live service logs what is new, once
    found = state.unreadable  # (the `loads` events at seqs 1 and 4 are anomalies of their own)
    assert [a.seq for a in found] == [2, 3] and found[1].event_type == "ReplicaTeleported"
    assert "newer version" in found[1].message
    assert all(a in state.new_anomalies(0) for a in found)


async def test_follower_recovers_from_slow_consumer_drops(nats_server, event_log):
    n = 3000
    for i in range(0, n, 500):
        await event_log.append(loads(500, i), i)
    slow = await JetStreamEventLog.open(nats_server.url, ensure=False)
    slow.pending_msgs_limit = 64  # nats-py drops past this: the follower must notice and resubscribe
    try:
        seqs = []
        with capture_logs() as logs:
            async for seq, _ in slow.follow(1):
                seqs.append(seq)
                if len(seqs) % 100 == 0:
                    await asyncio.sleep(0.02)  # fall behind
                if seq == n:
                    break
        assert seqs == list(range(1, n + 1))
        recovered = [e for e in logs if e["event"] in ("event_feed_gap", "event_feed_stalled")]
        assert recovered, "no drop happened; the test proves nothing"
    finally:
        await slow.close()


async def test_sigkill_loses_no_acknowledged_event(tmp_path):
    srv = EmbeddedNats(tmp_path / "store")
    srv.start()
    try:
        log = await JetStreamEventLog.open(srv.url)
        events = scripted_history(30)
        seq = 0
        for i in range(0, len(events), 3):
            chunk = events[i:i + 3]
            seq = (await log.append(chunk, seq)).last_seq
        before = fold(await collect(log.read()), ClusterState())
        srv.kill()
        srv.start()  # same store, same port: the connection reconnects by itself
        for _ in range(100):
            try:
                last = await log.last_seq()
                break
            except Exception:  # noqa: BLE001 - reconnecting
                await asyncio.sleep(0.1)
        assert last == seq
        after = fold(await collect(log.read()), ClusterState())
        assert after == before and after.seq == len(events)
        await log.close()
    finally:
        srv.close()
