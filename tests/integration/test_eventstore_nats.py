"""JetStream-specific behaviour of the event store, against a real nats-server (no mocks)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime

import pytest
from nats.js import api
from structlog.testing import capture_logs

from controlplane.core.projections import ClusterState, fold
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.factgate import fact_gate
from controlplane.store.eventstore import JetStreamEventLog, topology
from schemas.errors import ConflictError, InfrastructureError, InvalidCommand
from schemas.events import GpuInfo, NodeJoined, encode_event, event_headers, event_subject
from schemas.subjects import (
    EVENTS_ALL,
    EVENTS_STREAM,
    FACT_GATE_CONSUMER,
    FACT_LOG_SUBJECTS,
    FACTS_STREAM,
    FACTS_SUBJECTS,
    HDR_FACT_SEQ,
    LOG_SUBJECTS,
    REQUESTS_STREAM,
    fact_inbox,
    is_fact_subject,
    node_subject,
)
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


# ---- observed facts through NDIF_FACTS -----------------------------------------------------------


def _fact(node: str, event_id: str) -> NodeJoined:
    return NodeJoined(event_id=event_id, ts=datetime.now(UTC), actor=f"agent:{node}", node_id=node,
                      gpus=(GpuInfo(index=0, memory_bytes=10**9),), cpu_cache_bytes=0)


async def _in_log(log: JetStreamEventLog, event_id: str, timeout: float = 5.0) -> int:
    """The log sequence of `event_id` once the log has it (a fact: once sourced from NDIF_FACTS)."""
    async with asyncio.timeout(timeout):
        while True:
            found = [seq async for seq, e in log.read() if getattr(e, "event_id", None) == event_id]
            if found:
                assert len(found) == 1, found
                return found[0]
            await asyncio.sleep(0.02)


async def test_a_fact_is_stored_in_the_facts_stream_and_reaches_the_log_once(ungated_event_log):
    event_log = ungated_event_log
    await event_log.append(loads(1), 0)
    fact = _fact("gpu-a", "fact-1")
    assert is_fact_subject(event_subject(fact))
    async with fact_gate(event_log) as gate:
        got = await event_log.append([fact], None)
        assert (got.first_seq, got.last_seq, got.already_appended) == (0, 0, False)  # no log sequence
        seq = await _in_log(event_log, "fact-1")
        raw = await event_log.js.get_msg(EVENTS_STREAM, seq, direct=True)
        assert raw.subject == event_subject(fact) and raw.headers[HDR_FACT_SEQ] == "1"  # admitted by the gate
        assert raw.headers["Nats-Msg-Id"] == "fact-1" and raw.headers["Ndif-Event"] == "NodeJoined"
        again = await event_log.append([fact], None)  # a resend: the facts stream's window drops it
        assert again.already_appended and (again.first_seq, again.last_seq) == (0, 0)
        await asyncio.sleep(0.2)
        assert await _in_log(event_log, "fact-1") == seq and gate.admitted == 1
    # Guarded, or in a batch: refused before anything is sent (the facts stream takes no batches,
    # and its sequences are not the log's).
    for events, expected in (([_fact("gpu-a", "fact-2")], await event_log.last_seq()),
                             ([_fact("gpu-a", "fact-3"), *loads(1, 7)], None)):
        with pytest.raises(InvalidCommand, match="observed fact is appended alone"):
            await event_log.append(events, expected)
    info = await event_log.js.stream_info(FACTS_STREAM)
    assert info.state.last_seq == 1 and not info.config.allow_atomic


async def test_without_a_gate_a_fact_waits_and_says_why(ungated_event_log):
    """No controller, no gate: the fact is kept in NDIF_FACTS, the log has nothing, and the append
    ends with what to run; once a gate runs, the agent's resend lands it once."""
    event_log = ungated_event_log
    fact = _fact("gpu-a", "fact-waits")
    event_log.timeout = 1.0
    with pytest.raises(InfrastructureError, match="is a controller running"):
        await event_log.append([fact], None)
    assert await event_log.last_seq() == 0
    async with fact_gate(event_log):
        assert (await event_log.append([fact], None)).already_appended
        assert await _in_log(event_log, "fact-waits") == 1


async def test_a_refused_fact_ends_its_append_refused(ungated_event_log):
    """A fact the gate refuses (here: about a replica the log never placed) is not in the log, and its
    append ends FactRefused with the reason at once, not after its timeout."""
    from schemas.events import ReplicaLoaded
    from schemas.keys import canonical_model_key
    from schemas.refusals import FactRefused

    ghost = ReplicaLoaded(event_id="ghost", ts=datetime.now(UTC), actor="agent:gpu-a", node_id="gpu-a",
                          model_key=canonical_model_key("openai-community/gpt2"), replica_id=3, load_seconds=1.0)
    event_log = ungated_event_log
    async with fact_gate(event_log) as gate:
        with pytest.raises(FactRefused, match="never placed"):
            await asyncio.wait_for(event_log.append([ghost], None), 4.0)
        assert gate.refused == 1
    assert await event_log.last_seq() == 0


async def test_a_facts_id_taken_by_another_message_is_refused(event_log):
    """Anyone who may publish facts may send any Nats-Msg-Id: a fact the facts stream drops as the
    duplicate of another message is refused, never reported as stored."""
    fact = _fact("gpu-a", "fact-taken")
    await event_log.js.publish(fact_inbox(event_subject(fact)), b'{"junk": 1}', headers={"Nats-Msg-Id": "fact-taken"})
    with pytest.raises(InfrastructureError, match="is taken in NDIF_FACTS"):
        await event_log.append([fact], None)


async def test_a_log_that_sourced_the_facts_stream_is_migrated_by_ensure(tmp_path):
    """The streams as the version before the gate made them (the facts stream on the facts' log
    subjects, the log sourcing it): `ensure` moves the facts stream to the inboxes, makes the log take
    the facts' subjects itself without a source, and starts the gate after the facts the source had
    copied; what was stored is read as before, and a new fact goes through the gate once."""
    with EmbeddedNats(tmp_path / "nats") as srv:
        log = await JetStreamEventLog.open(srv.url, ensure=False)
        try:
            old_facts = dataclasses.replace(topology.facts_config(1), subjects=list(FACT_LOG_SUBJECTS))
            await log.js.add_stream(old_facts)
            narrow = [s for s in LOG_SUBJECTS if s not in FACT_LOG_SUBJECTS]
            await log.js.add_stream(dataclasses.replace(topology.events_config(1), subjects=narrow,
                                                        sources=[api.StreamSource(name=FACTS_STREAM)]))
            before = _fact("gpu-a", "joined-before")  # as agents appended it then: on the log subject
            await log.js.publish(event_subject(before), encode_event(before), headers=event_headers(before))
            assert await _in_log(log, "joined-before") == 1  # sourced
            await log.ensure()
            cfg = (await log.js.stream_info(EVENTS_STREAM)).config
            assert sorted(cfg.subjects or []) == sorted(LOG_SUBJECTS) and not cfg.sources and cfg.allow_atomic
            assert (await log.js.stream_info(FACTS_STREAM)).config.subjects == list(FACTS_SUBJECTS)
            gate_cfg = (await log.js.consumer_info(FACTS_STREAM, FACT_GATE_CONSUMER)).config
            assert gate_cfg.opt_start_seq == 2  # after the fact the source copied
            async with fact_gate(log):
                await log.append([_fact("gpu-b", "joined-after")], None)
                assert await _in_log(log, "joined-after") == 2
            stored = await collect(log.read())
            assert [e.event_id for _, e in stored] == ["joined-before", "joined-after"]
            with capture_logs() as logs:
                await log.ensure()
            assert not [e for e in logs if e["event"] in ("stream_updated", "stream_created", "consumer_created")]
        finally:
            await log.close()


async def test_a_log_made_before_the_facts_stream_is_migrated_by_ensure(tmp_path):
    """The log as an earlier version still made it (every event subject, agents' facts appended
    straight in): a fact sent before `ensure` finds no stream, refused loudly (retryable); `ensure`
    makes the facts stream and narrows the log; the agent's retry lands the fact through the gate."""
    with EmbeddedNats(tmp_path / "nats") as srv:
        log = await JetStreamEventLog.open(srv.url, ensure=False)
        try:
            old = dataclasses.replace(topology.events_config(1), subjects=[EVENTS_ALL], sources=None)
            await log.js.add_stream(old)
            before = _fact("gpu-a", "joined-before")  # on the node's own subject, as agents appended it
            await log.js.publish(node_subject("gpu-a"), encode_event(before), headers=event_headers(before))
            late = _fact("gpu-b", "joined-between")
            with pytest.raises(InfrastructureError, match=f"create {FACTS_STREAM}") as refused:
                await log.append([late], None)
            assert refused.value.retryable
            with capture_logs() as logs:
                await log.ensure()
            assert FACTS_STREAM in [e.get("stream") for e in logs if e["event"] == "stream_created"]
            cfg = (await log.js.stream_info(EVENTS_STREAM)).config
            assert sorted(cfg.subjects or []) == sorted(LOG_SUBJECTS) and cfg.allow_atomic and not cfg.sources
            async with fact_gate(log):
                await log.append([late], None)  # the agent's retry
                assert await _in_log(log, "joined-between") == 2
            stored = await collect(log.read())
            assert [e.event_id for _, e in stored] == ["joined-before", "joined-between"]
        finally:
            await log.close()


async def test_a_role_that_may_not_migrate_the_log_refuses_to_work_on_it_unmigrated(tmp_path):
    """The controller and the dispatcher (roles that check the streams and create nothing) stop with
    what to do on a log made before the facts stream, rather than run where an agent's batches reach
    the log (the attack decision 48 closed)."""
    with EmbeddedNats(tmp_path / "nats") as srv:
        log = await JetStreamEventLog.open(srv.url, ensure=False)
        try:
            await log.js.add_stream(dataclasses.replace(topology.events_config(1), subjects=[EVENTS_ALL], sources=None))
            await topology.ensure_stream(log.js, api.StreamConfig(name=REQUESTS_STREAM, subjects=["ndif.req.>"],
                                                                  retention=api.RetentionPolicy.WORK_QUEUE))
            with pytest.raises(InfrastructureError, match="ndif up"):
                await topology.ensure(log.js, replicas=1, may_create=False)
            await log.ensure()  # an admin's `ndif up`
            await topology.ensure(log.js, replicas=1, may_create=False)  # then every role starts
        finally:
            await log.close()


async def test_a_request_stream_made_before_partitions_is_migrated_and_loses_no_request(tmp_path):
    """A request stream as an earlier version made it (no subject transform), holding a user's request
    and its model's old consumer `proc-<mtok>`: `ensure` adds the transform, later requests are stored
    under the user's partition, and the dispatcher's consumers take both, each once."""
    from dataplane.serving.jetstream import JetStreamRequests
    from schemas.subjects import request_consumer, request_partition

    with EmbeddedNats(tmp_path / "nats") as srv:
        log = await JetStreamEventLog.open(srv.url)
        try:
            await log.js.delete_stream(REQUESTS_STREAM)
            await log.js.add_stream(api.StreamConfig(name=REQUESTS_STREAM, subjects=["ndif.req.>"],
                                                     retention=api.RetentionPolicy.WORK_QUEUE))
            tok = "m-0123456789"
            await log.js.add_consumer(REQUESTS_STREAM, api.ConsumerConfig(
                durable_name=request_consumer(tok), filter_subjects=[f"ndif.req.{tok}", f"ndif.req.{tok}.*"],
                ack_policy=api.AckPolicy.EXPLICIT))
            await log.js.publish(f"ndif.req.{tok}.alice", b"before")
            await log.ensure()
            cfg = (await log.js.stream_info(REQUESTS_STREAM)).config
            assert cfg.subject_transform is not None and cfg.subject_transform.src == "ndif.req.*.*"
            ack = await log.js.publish(f"ndif.req.{tok}.alice", b"after")
            stored = await log.js.get_msg(REQUESTS_STREAM, ack.seq)
            assert stored.subject == f"ndif.req.{tok}.alice.{request_partition('alice')}"
            got: list[tuple[str, bytes]] = []

            async def on_delivery(m, attempt):
                got.append((m.subject, m.data))
                await m.ack()

            requests = JetStreamRequests(log.nc, log.js, ack_wait_s=5.0, fetch_batch=8)
            task = asyncio.create_task(requests.consume(tok, on_delivery, hold=lambda _k: False))
            try:
                async with asyncio.timeout(10):
                    while len(got) < 2 or (await log.js.stream_info(REQUESTS_STREAM)).state.messages:
                        await asyncio.sleep(0.05)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert sorted(data for _, data in got) == [b"after", b"before"]
        finally:
            await log.close()


async def test_a_new_history_takes_none_of_the_facts_of_the_dropped_one(ungated_event_log):
    """A fact of the old history still waiting in NDIF_FACTS (no gate ran) is not admitted into a
    history made anew: its gate starts after it."""
    event_log = ungated_event_log
    event_log.timeout = 1.0
    with pytest.raises(InfrastructureError, match="is a controller running"):
        await event_log.append([_fact("gpu-a", "fact-of-the-old-history")], None)
    await event_log.js.delete_stream(EVENTS_STREAM)
    await event_log.ensure(start_new_history=True)
    event_log.timeout = 5.0
    async with fact_gate(event_log):
        await event_log.append([_fact("gpu-a", "fact-of-the-new-history")], None)
        assert await _in_log(event_log, "fact-of-the-new-history") == 1
    assert await event_log.last_seq() == 1
