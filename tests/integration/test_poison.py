"""Trust that holds from outside: each attack with the attacker role's real credentials, on a real
nats-server run with the config `ndif up` generates; the legitimate roles still do their jobs.

- junk on a node agent's own fact subjects never enters the log (the fact gate refuses it, counted
  where the operator sees it), and stops no reader (controller, agents, dashboard, `ndif status`);
- junk on a node's heartbeat key keeps no node alive;
- a node agent cannot announce capacity the operator did not declare;
- a request may name only a model the operator offers, and learns nothing of the filesystem;
- poison requests end (ERROR, or terminated when no status key can be formed), and a request
  delivered REQUEST_MAX_DELIVER times ends `DeadLetter` without running.

Agents run over the in-memory runtime (tests/fake_runtime.py): no replica runs here;
tests/dataplane/test_poison_requests.py serves through real replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.js.errors
import pytest
import pytest_asyncio

from controlplane.dashboard import Dashboard
from controlplane.ops.auth import LocalAuth, ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.service.factgate import fact_gate
from controlplane.service.registry import ModelRoots
from controlplane.store.admin import AdminClient
from controlplane.store.credentials import IMPORTED_JS_API, Creds, request_msg_id
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client, RequestFailed
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.serving.dispatcher import Dispatcher
from dataplane.serving.dispatcher.intake import REQUEST_MAX_DELIVER
from schemas import errors as errs
from schemas import events as E
from schemas.guard import Refused, decode_any
from schemas.inventory import CardGroup, Inventory, NodeInventory
from schemas.keys import canonical_model_key, display_name
from schemas.refusals import decode_refusal
from schemas.requests import Request, encoder, status_decoder
from schemas.status import ReplicaState
from schemas.subjects import (
    EVENTS_STREAM,
    FACTS_STREAM,
    HDR_FACT_SEQ,
    HEARTBEATS_BUCKET,
    REFUSED_STREAM,
    REQUEST_STATUS_BUCKET,
    REQUESTS_STREAM,
    command_event_subject,
    fact_inbox,
    fact_log_subject,
    model_token,
    node_facts_from,
    node_token,
    refused_subject,
    request_consumer,
    request_consumers,
    request_partition,
    request_subject,
    status_key,
)
from tests.checkpoints import TinyModels
from tests.conftest import bounded
from tests.fake_runtime import FakeRuntime
from tests.integration.cluster import ndif
from tests.integration.conftest import NODE_A, NODE_B
from tests.integration.probe import raw_connect
from tests.strategies import MSGSPEC_BAD_UTF8
from tests.waiting import until, until_state

pytestmark = pytest.mark.timeout(180)
GB = 10**9
TWO_80 = NodeInventory(cards=(CardGroup(count=2, memory_bytes=80 * GB, kind="H100"),))
INVENTORY = Inventory(nodes={NODE_A: TWO_80, NODE_B: TWO_80})
POISON_NESTED = b"[" * 3000 + b"]" * 3000  # 6 KB of nested arrays
POISON_UTF8 = b'{"type":"NodeJoined","event_id":"\xff"}'  # 36 bytes, invalid UTF-8 inside a string


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def auth(home: Path) -> LocalAuth:
    return ensure_local([NODE_A, NODE_B], clients=["alice", "bob"], home=home)


@pytest_asyncio.fixture
async def url(auth: LocalAuth, tmp_path: Path) -> AsyncIterator[str]:
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        lg = await JetStreamEventLog.open(srv.url, creds=auth.role("admin"))  # what `ndif up` does first
        await lg.close()
        yield srv.url


def checkpoint(root: Path, name: str) -> str:
    """A checkpoint dir with only a config (its size comes with the deploy): enough for placement."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    return canonical_model_key(str(d))


async def as_user(url: str, creds: Creds) -> Any:
    return await raw_connect(url, **creds.connect_options())


async def append_raw(nc: Any, subject: str, body: bytes, msg_id: str) -> int:
    """What any holder of a subject can send there: a body of its choosing. On an agent's fact
    subject it is stored in NDIF_FACTS and the fact gate decides: its sequence in the log once
    admitted, 0 once refused."""
    ack = await nc.jetstream().publish(subject, body, headers={"Nats-Msg-Id": msg_id})
    if ack.stream != FACTS_STREAM:
        return int(ack.seq)
    return await gate_decided(nc, subject, int(ack.seq))


async def gate_decided(nc: Any, subject: str, facts_seq: int, timeout: float = 10.0) -> int:
    """Read as the agent reads (direct gets through its account's imports): the log sequence of the
    fact at `facts_seq` once the gate admitted it, 0 once the gate's last refusal of its source names it."""
    js = nc.jetstream(prefix=IMPORTED_JS_API)
    log_subject = fact_log_subject(subject)
    assert log_subject is not None, subject
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                r = await js.get_msg(REFUSED_STREAM, subject=refused_subject(subject.rsplit(".", 1)[-1], facts_seq),
                                     direct=True)
                assert decode_refusal(r.data).facts_seq == facts_seq
                return 0
            with contextlib.suppress(nats.js.errors.NotFoundError):
                m = await js.get_msg(EVENTS_STREAM, subject=log_subject, direct=True)
                if m.headers and m.headers.get(HDR_FACT_SEQ) == str(facts_seq):
                    return int(m.seq or 0)
            await asyncio.sleep(0.01)


def own(node: str) -> str:
    """A node agent's own subject for its node's facts (what it sends; the log's is `ndif.evt.…`)."""
    return fact_inbox(node_facts_from(node_token(node)))


async def agent(url: str, auth: LocalAuth, node: str, **kw: Any) -> NodeAgent:
    return await (await NodeAgent.open(url, node, creds=auth.role(f"agent:{node}"), runtime=FakeRuntime(f"sim:{node}"),
                                       gpus=declared_gpus(2, 80 * GB), cpu_cache_bytes=10 * GB, heartbeat_s=0.3,
                                       health_interval_s=0.3, drain_timeout_s=0.0, **kw)).start()


async def status_json(url: str, home: Path) -> dict[str, Any]:
    ran = await ndif(url, "status", "--json", timeout=30, env={"NDIF_HOME": str(home)})
    assert ran.rc == 0, ran.err
    out: dict[str, Any] = json.loads(ran.out)
    return out


# ---- poison events ---------------------------------------------------------------------------


async def test_junk_on_an_agents_own_fact_subjects_never_enters_the_log(url: str, auth: LocalAuth, home: Path,
                                                                       tmp_path: Path) -> None:
    """Node A's agent, with its real credentials, sends junk on its own fact subjects: bodies that do
    not decode, unknown types, wrong field types, arrays, nothing, a fact about another node, a
    decision, a fact about a replica never placed, an oversized heartbeat. Nothing of it is appended
    to the log: each is refused by the fact gate before it is kept there, counted where the operator
    sees it (`ndif status`), and the agent learns each refusal of its own; every reader goes on."""
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    legit = await agent(url, auth, NODE_B)
    dash = await Dashboard.from_url(url, port=0, creds=auth.role("dashboard")).start()
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))  # node A's agent, on its own subjects
    admin = await AdminClient.open(url, timeout=10, creds=auth.role("admin"))
    try:
        await until(lambda: NODE_B in ctl.state.nodes, timeout=15)
        since = await admin.log.last_seq()
        now = datetime.now(UTC)
        other = E.NodeJoined(event_id="a-says-b", ts=now, actor=f"agent:{NODE_A}", node_id=NODE_B,
                             gpus=declared_gpus(1, GB), cpu_cache_bytes=0)
        ghost = E.ReplicaLoaded(event_id="a-ghost", ts=now, actor=f"agent:{NODE_A}", node_id=NODE_A,
                                model_key=canonical_model_key("openai-community/gpt2"), replica_id=0, load_seconds=1.0)
        decision = E.NodeLost(event_id="a-lost", ts=now, actor=f"agent:{NODE_A}", node_id=NODE_B)
        wrong_types = (b'{"type":"NodeJoined","event_id":"w","ts":"2026-11-01T00:00:00Z","actor":"agent:' + NODE_A.encode()
                       + b'","node_id":"' + NODE_A.encode() + b'","gpus":"all of them","cpu_cache_bytes":"1"}')
        junk = [(own(NODE_A), POISON_NESTED), (own(NODE_A), POISON_UTF8), (own(NODE_A), b'{"x":' + POISON_NESTED + b"}"),
                (own(NODE_A), b""), (own(NODE_A), b"[1, 2]"), (own(NODE_A), b'{"type":"NodeRebooted","event_id":"u"}'),
                (own(NODE_A), wrong_types), (own(NODE_A), E.encode_event(other)), (own(NODE_A), E.encode_event(decision)),
                (fact_inbox(E.event_subject(ghost)), E.encode_event(ghost))]
        for i, (subject, body) in enumerate(junk):
            assert await append_raw(mallory, subject, body, f"junk-{i}") == 0, (i, body[:60])
        assert ctl.gate.refused == len(junk)
        # A heartbeat over its bound is refused by the bucket before it is kept.
        with pytest.raises(nats.js.errors.APIError, match="maximum"):
            await mallory.jetstream().publish(f"$KV.{HEARTBEATS_BUCKET}.{node_token(NODE_A)}", b"h" * 600_000)
        # The controller still answers commands and decides; the agent loads what it asks.
        model = checkpoint(tmp_path, "m")
        res = await asyncio.wait_for(admin.deploy(model, 1, size_bytes=GB), 15)
        assert res.ok and res.replicas and res.replicas[0].node_id == NODE_B, res
        await until(lambda: (r := legit.state.replicas.get((model, 0))) is not None
                    and r.state is ReplicaState.AVAILABLE, timeout=15)
        await until(lambda: dash.model.seq >= res.last_seq, timeout=15)
        for st in (ctl.state, legit.state, dash.model.live):
            assert st.skipped == 0 and st.anomaly_count == 0, (st.skipped, st.anomalies)
        async for _, e in admin.log.read(since + 1):  # nothing of node A's since: only the deploy and B's facts
            assert not isinstance(e, E.Skipped) and getattr(e, "node_id", NODE_B) == NODE_B, e
        status = await status_json(url, home)  # `ndif status` counts them, with the newest reason
        assert status["skipped"] == 0 and [m["model_key"] for m in status["models"]] == [model]
        assert status["refused_facts"]["count"] == len(junk), status["refused_facts"]
        assert "never placed" in status["refused_facts"]["last"]["reason"]
        # Node A's agent reads its own refusals; node B's are not its to read.
        js = mallory.jetstream(prefix=IMPORTED_JS_API)
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.get_msg(REFUSED_STREAM, subject=refused_subject(node_token(NODE_B), 1), direct=True)
    finally:
        await mallory.close()
        await admin.close()
        await bounded(dash.stop(), "dashboard.stop")
        await bounded(legit.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


async def hpub(nc: Any, subject: str, header_block: bytes, payload: bytes) -> None:
    """Publish with a header block of one's own bytes exactly (what any client library could send)
    and wait for the stream's ack."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    cmd = b"HPUB %s %s %d %d\r\n" % (subject.encode(), inbox.encode(), len(header_block),
                                      len(header_block) + len(payload))
    await nc._send_command(cmd + header_block + payload + b"\r\n")
    await nc.flush()
    await sub.next_msg(timeout=5)


# A stored message whose header block looks like a server's status in another version, or that
# carries a `Status` line of its own: the server keeps both as they are.
FORGED_STATUSES = [
    (b"NATS/1.1 204 EOB\r\nNats-Msg-Id: forged-0\r\n\r\n", b'{"v":0}'),
    (b"EVIL/1.0 204 EOB\r\nNats-Msg-Id: forged-1\r\n\r\n", b'{"v":1}'),
    (b"EVIL/1.0 409\r\nNats-Msg-Id: forged-2\r\nDescription: Consumer Deleted\r\n\r\n", b""),
    (b"NATS/1.0\r\nNats-Msg-Id: forged-3\r\nStatus: 100\r\nDescription: Idle Heartbeat\r\n"
     b"Nats-Last-Consumer: 0\r\nNats-Last-Stream: 0\r\n\r\n", b""),
]


async def test_a_fact_dressed_as_a_server_status_never_reaches_a_reader(
        url: str, auth: LocalAuth, tmp_path: Path) -> None:
    """Facts whose header block begins `NATS/1.1 204` or `EVIL/1.0 204` (which direct-reading
    followers once took for the end of a read) are kept out of the log by the fact gate: it stores
    only what decodes, under headers of its own. No reader's fold moves; the log has no gap."""
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    legit = await agent(url, auth, NODE_B)
    dash = await Dashboard.from_url(url, port=0, creds=auth.role("dashboard")).start()
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    admin = await AdminClient.open(url, timeout=10, creds=auth.role("admin"))
    try:
        before = [st.skipped for st in (ctl.state, legit.state, dash.model.live)]
        for header_block, payload in FORGED_STATUSES:
            await hpub(mallory, own(NODE_A), header_block, payload)
        await until(lambda: ctl.gate.refused == len(FORGED_STATUSES), timeout=10)
        model = checkpoint(tmp_path, "m")
        res = await asyncio.wait_for(admin.deploy(model, 1, size_bytes=GB), 15)
        assert res.ok, res
        await until(lambda: (r := legit.state.replicas.get((model, 0))) is not None
                    and r.state is ReplicaState.AVAILABLE, timeout=15)
        await until(lambda: dash.model.seq >= res.last_seq, timeout=15)
        assert [st.skipped for st in (ctl.state, legit.state, dash.model.live)] == before
        # A fresh fold from the start, read as the dashboard reads it: every sequence, none twice.
        seqs = [seq async for seq, _ in dash.log.read(1, stop_seq=res.last_seq)]
        assert seqs == list(range(1, res.last_seq + 1))
    finally:
        await mallory.close()
        await admin.close()
        await bounded(dash.stop(), "dashboard.stop")
        await bounded(legit.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


# ---- heartbeats --------------------------------------------------------------------------------


async def test_junk_on_a_heartbeat_key_keeps_no_node_alive(url: str, auth: LocalAuth, home: Path) -> None:
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2,
                                    heartbeat_grace_s=2.0).start()
    legit = await agent(url, auth, NODE_B)
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    try:
        joined = E.NodeJoined(event_id="a-joined", ts=datetime.now(UTC), actor=f"agent:{NODE_A}", node_id=NODE_A,
                              gpus=declared_gpus(1, GB), cpu_cache_bytes=0)
        await append_raw(mallory, own(NODE_A), E.encode_event(joined), "a-joined")
        key = f"$KV.{HEARTBEATS_BUCKET}.{node_token(NODE_A)}"
        junk = [b"x" * 600_000, NODE_B.encode(), b"\xff\xfe", NODE_A.encode() + b" " * 300]

        async def beat_junk() -> None:
            while True:
                for body in junk:
                    await mallory.publish(key, body)
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(beat_junk())
        try:
            await until(lambda: NODE_A in ctl.state.nodes and not ctl.state.nodes[NODE_A].alive, timeout=15)
        finally:
            beating.cancel()
        assert ctl.state.nodes[NODE_B].alive  # the honest agent's beats count
        status = await status_json(url, home)
        hb = {n["node_id"]: n["heartbeat_age_s"] for n in status["nodes"]}
        assert hb[NODE_A] is None and hb[NODE_B] is not None  # junk is no heartbeat to `ndif status` either
    finally:
        await mallory.close()
        await bounded(legit.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


async def test_a_rollup_on_an_agents_own_heartbeat_key_erases_no_other_nodes(url: str, auth: LocalAuth) -> None:
    """`Nats-Rollup: all` on its own key would purge the whole bucket: the bucket allows no rollup."""
    honest = await as_user(url, auth.role(f"agent:{NODE_A}"))
    mallory = await as_user(url, auth.role(f"agent:{NODE_B}"))
    admin = await as_user(url, auth.role("admin"))
    try:
        await honest.jetstream().publish(f"$KV.{HEARTBEATS_BUCKET}.{node_token(NODE_A)}", NODE_A.encode())
        with pytest.raises(nats.js.errors.Error):
            await mallory.jetstream().publish(f"$KV.{HEARTBEATS_BUCKET}.{node_token(NODE_B)}", NODE_B.encode(),
                                              headers={"Nats-Rollup": "all"})
        kept = await admin.jetstream().get_last_msg(f"KV_{HEARTBEATS_BUCKET}",
                                                    f"$KV.{HEARTBEATS_BUCKET}.{node_token(NODE_A)}")
        assert kept.data == NODE_A.encode()
    finally:
        for nc in (honest, mallory, admin):
            await nc.close()


async def test_an_agent_cannot_take_an_event_id_in_the_log(url: str, auth: LocalAuth) -> None:
    """An agent may send any Nats-Msg-Id, but only to the facts stream: the log's ids are the gate's
    and the controller's. The controller's append under the id the agent sent first lands."""
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    log = await JetStreamEventLog.open(url, creds=auth.role("controller"), ensure=False)
    async with fact_gate(log):
        try:
            assert await append_raw(mallory, own(NODE_A), b'{"junk": 1}', "cmd-taken-first.0") == 0
            at = await log.last_seq()
            ev = E.NodeLost(event_id="cmd-taken-first.0", ts=datetime.now(UTC), actor="controller:t", node_id=NODE_B)
            got = await log.append([ev], at)
            assert got.first_seq == at + 1 and not got.already_appended
        finally:
            await mallory.close()
    await log.close()


async def test_an_agent_that_claims_the_controllers_next_ids_does_not_keep_a_dead_node_alive(
        url: str, auth: LocalAuth) -> None:
    """The ids a controller would derive from the log (its position) are claimed first by another
    node's agent: the decision's id carries the controller's own secret, and the node is declared lost."""
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2,
                                    heartbeat_grace_s=1.0).start()
    victim = await as_user(url, auth.role(f"agent:{NODE_B}"))
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    try:
        joined = E.NodeJoined(event_id="b-joined", ts=datetime.now(UTC), actor=f"agent:{NODE_B}", node_id=NODE_B,
                              gpus=declared_gpus(1, GB), cpu_cache_bytes=0)
        since = await append_raw(victim, own(NODE_B), E.encode_event(joined), "b-joined")
        await victim.jetstream().publish(f"$KV.{HEARTBEATS_BUCKET}.{node_token(NODE_B)}", NODE_B.encode())
        for i in range(4):  # what the position-only id would have been, for a decision of up to 4 events
            await append_raw(mallory, own(NODE_A), b"{}", f"policy-node-lost-{node_token(NODE_B)}-{since}.{i}")
        stored: list[Any] = []

        async def lost_in_the_log() -> bool:  # the log, not the controller's own view of what it appended
            stored[:] = [e async for _, e in ctl.log.read(since + 1)]
            return any(isinstance(e, E.NodeLost) and e.node_id == NODE_B for e in stored)

        deadline = asyncio.get_running_loop().time() + 20
        while not await lost_in_the_log():
            assert asyncio.get_running_loop().time() < deadline, [type(e).__name__ for e in stored]
            await asyncio.sleep(0.2)
    finally:
        await mallory.close()
        await victim.close()
        await bounded(ctl.stop(), "controller.stop")


async def test_an_agents_open_atomic_batches_block_none_of_the_controllers_decisions(
        url: str, auth: LocalAuth, tmp_path: Path) -> None:
    """Node A's agent opens 60 atomic batches on its own fact subjects (`Nats-Batch-Id`, sequence 1,
    never committed). The server's limit on batches in flight is per stream (50): were they opened
    in the log's stream, the controller's batched appends would be refused (10176) until they
    expired. Agents' facts are stored in NDIF_FACTS, which allows no batches: each is refused there
    (10174), nothing is stored in either stream, and the controller's multi-event appends land."""
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    legit = await agent(url, auth, NODE_B)
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    admin = await AdminClient.open(url, timeout=10, creds=auth.role("admin"))
    log = await JetStreamEventLog.open(url, creds=auth.role("controller"), ensure=False)
    try:
        await until(lambda: NODE_B in ctl.state.nodes, timeout=15)
        js = admin.log.js
        since = await log.last_seq()
        joined = E.NodeJoined(event_id="a-joined", ts=datetime.now(UTC), actor=f"agent:{NODE_A}", node_id=NODE_A,
                              gpus=declared_gpus(1, GB), cpu_cache_bytes=0)
        loaded = E.ReplicaLoaded(event_id="a-loaded", ts=datetime.now(UTC), actor=f"agent:{NODE_A}", node_id=NODE_A,
                                 model_key=canonical_model_key("openai-community/gpt2"), replica_id=0,
                                 load_seconds=1.0)
        answers: list[bytes] = []
        inbox = mallory.new_inbox()

        async def answered(m: Any) -> None:
            answers.append(m.data)

        sub = await mallory.subscribe(inbox, cb=answered)
        for i in range(60):
            ev = joined if i % 2 else loaded  # its node's subject and a replica fact's, both its own
            await mallory.publish(fact_inbox(E.event_subject(ev)), E.encode_event(ev), reply=inbox,
                                  headers={"Nats-Batch-Id": f"never-committed-{i}", "Nats-Batch-Sequence": "1"})
        await mallory.flush()
        # The controller's multi-event decisions: a deploy of 2 replicas, and 2 events appended at once.
        res = await asyncio.wait_for(admin.deploy(checkpoint(tmp_path, "m"), 2, size_bytes=GB), 15)
        assert res.ok and len(res.replicas) == 2 and res.last_seq - res.first_seq >= 1, res
        two = [E.NodeDeclared(event_id=f"declared-{i}", ts=datetime.now(UTC), actor="controller:t", command_id="t",
                              node_id=n, node=TWO_80) for i, n in enumerate((NODE_A, NODE_B))]
        for _ in range(50):  # the honest agent's facts move the log meanwhile
            with contextlib.suppress(errs.ConflictError):
                got = await asyncio.wait_for(log.append(two, await log.last_seq()), 5)
                break
        assert got.last_seq == got.first_seq + 1 and not got.already_appended
        await until(lambda: len(answers) == 60, timeout=5)
        await sub.unsubscribe()
        codes = {msgspec.json.decode(a)["error"]["err_code"] for a in answers}
        assert codes == {10174}, answers[:3]  # "atomic publish is disabled"
        for mine in (fact_inbox(E.event_subject(joined)), fact_inbox(E.event_subject(loaded))):  # none stored
            assert not (await js.stream_info(FACTS_STREAM, subjects_filter=mine)).state.subjects, mine
        async for _, e in log.read(since + 1):
            assert not (isinstance(e, E.Skipped) or e.event_id in ("a-joined", "a-loaded")), e
    finally:
        await log.close()
        await mallory.close()
        await admin.close()
        await bounded(legit.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


async def test_an_agents_largest_fact_does_not_stop_the_log_from_taking_facts(url: str, auth: LocalAuth) -> None:
    """Node A's agent stores in NDIF_FACTS the largest message it takes (padded with headers), and one
    byte more is refused there. The gate decides on it (refused: a replica never placed) and goes
    on: node B's agent then joins, and the log has it."""
    from controlplane.store.eventstore.topology import FACTS_MAX_MSG_BYTES

    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    legit = None
    try:
        loaded = E.ReplicaLoaded(event_id="a-big", ts=datetime.now(UTC), actor=f"agent:{NODE_A}", node_id=NODE_A,
                                 model_key=canonical_model_key("openai-community/gpt2"), replica_id=0,
                                 load_seconds=1.0)
        body = E.encode_event(loaded)
        pad = {f"X-Pad-{i}": "p" * 1000 for i in range(60)}
        head = len("NATS/1.0\r\n\r\n") + sum(len(f"{k}: {v}\r\n") for k, v in pad.items())
        head += len("Nats-Msg-Id: a-big\r\n")
        pad["X-Pad-0"] += "p" * (FACTS_MAX_MSG_BYTES - head - len(body))  # hdr + data: the limit exactly
        ack = await mallory.request(fact_inbox(E.event_subject(loaded)), body, headers={"Nats-Msg-Id": "a-big", **pad},
                                    timeout=5)
        assert msgspec.json.decode(ack.data).get("stream") == FACTS_STREAM, ack.data  # stored
        over = await mallory.request(fact_inbox(E.event_subject(loaded)), body + b" ", headers={"Nats-Msg-Id": "a-big-2", **pad},
                                     timeout=5)
        assert "error" in msgspec.json.decode(over.data), over.data  # one byte more: refused there
        legit = await agent(url, auth, NODE_B)
        await until(lambda: NODE_B in ctl.state.nodes, timeout=15)  # its NodeJoined went through the gate
        assert ctl.gate.refused == 1
    finally:
        await mallory.close()
        if legit is not None:
            await bounded(legit.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


# ---- inventory ---------------------------------------------------------------------------------


async def test_an_agent_cannot_announce_capacity_it_was_not_given(url: str, auth: LocalAuth, home: Path,
                                                                  tmp_path: Path) -> None:
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2,
                                    inventory=INVENTORY).start()
    legit = await agent(url, auth, NODE_B)
    mallory = await as_user(url, auth.role(f"agent:{NODE_A}"))
    admin = await AdminClient.open(url, timeout=10, creds=auth.role("admin"))
    try:
        for i, mem in enumerate((10**12, 400 * GB)):  # the issue's 8 x 1 TB, then 8 x 400 GB
            ev = E.NodeJoined(event_id=f"a-joined-{i}", ts=datetime.now(UTC), actor=f"agent:{NODE_A}",
                              node_id=NODE_A, gpus=declared_gpus(8, mem), cpu_cache_bytes=10 * GB)
            await append_raw(mallory, own(NODE_A), E.encode_event(ev), ev.event_id)
        # Nor can it declare itself: on its own subject the gate refuses it; the controller's is not its to send.
        forged = E.NodeDeclared(event_id="a-declared", ts=datetime.now(UTC), actor="controller:x", node_id=NODE_A,
                                command_id="x", node=NodeInventory(cards=(CardGroup(count=8, memory_bytes=400 * GB),)))
        assert await append_raw(mallory, own(NODE_A), E.encode_event(forged), forged.event_id) == 0
        with pytest.raises((nats.js.errors.APIError, nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await mallory.jetstream().publish(command_event_subject("x"), E.encode_event(forged), timeout=1)
        state = await until_state(admin, lambda s: NODE_A in s.nodes)
        assert [(g.index, g.memory_bytes) for g in state.nodes[NODE_A].gpus] == [(0, 80 * GB), (1, 80 * GB)]
        big = checkpoint(tmp_path, "big")  # 500 GB: fits 8 x 400 GB, not anything declared
        res = await admin.deploy(big, 1, size_bytes=500 * GB)
        assert not res.replicas and res.rejections and res.error == "PlacementError", res
        ok = await admin.deploy(checkpoint(tmp_path, "small"), 2, size_bytes=60 * GB)  # the operator's job
        assert ok.ok and {r.node_id for r in ok.replicas} <= {NODE_A, NODE_B}, ok
        status = await status_json(url, home)
        said = [a["message"] for a in status["anomalies"]]
        assert any(m.startswith(f"inventory of {NODE_A!r}") and "400000000000 bytes" in m for m in said), said
    finally:
        await mallory.close()
        await admin.close()
        await bounded(legit.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


# ---- models ------------------------------------------------------------------------------------


async def test_a_request_names_only_a_model_the_operator_offers(tiny_models: TinyModels, url: str, auth: LocalAuth, tmp_path: Path) -> None:

    root = tmp_path / "models"
    offered = canonical_model_key(str(tiny_models.gpt2(root / "tiny")))
    outside = tiny_models.gpt2(tmp_path / "private" / "tiny")  # a real checkpoint on the controller's machine
    (tmp_path / "private" / "empty").mkdir()
    ctl = await Controller.from_url(url, creds=auth.role("controller"), model_roots=ModelRoots((str(root),))).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
    admin = await AdminClient.open(url, timeout=30, creds=auth.role("admin"))
    try:
        async with Client(url, creds=auth.role("client:alice")) as alice:
            answers = []
            for path in (outside, tmp_path / "private" / "empty", tmp_path / "private" / "missing", Path("/etc"),
                         root / ".." / "private" / "tiny"):
                job = await alice.submit(str(path), {"op": "forward", "input_ids": [[1]]})
                with pytest.raises(RequestFailed) as exc:
                    await job.result(timeout=30)
                assert exc.value.error == "UnknownModel", exc.value
                answers.append(str(exc.value).replace(display_name(canonical_model_key(str(path))), "<model>"))
            assert len(set(answers)) == 1 and "not a model this service offers" in answers[0], answers
            state = await admin.state()
            assert not state.models  # nothing of them was registered or deployed
            # A model under the roots is deployed for a request (it waits for a node: none runs here).
            job = await alice.submit(offered, {"op": "forward", "input_ids": [[1]]})
            await until_state(admin, lambda s: offered in s.models and s.models[offered].registration is not None)
            await job.close()
            # A near name of an offered model: the same refusal, and the model it probably meant.
            typo = await alice.submit(str(root / "tinyy"), {"op": "forward", "input_ids": [[1]]})
            with pytest.raises(RequestFailed) as exc:
                await typo.result(timeout=30)
            assert exc.value.error == "UnknownModel" and "not a model this service offers" in str(exc.value)
            assert f"did you mean {display_name(offered)}?" in str(exc.value), exc.value
        res = await admin.deploy(str(outside), 1)  # the operator's own deploy is not limited to the roots
        assert res.first_seq and res.error == "PlacementError", res  # registered; no node to place it on
    finally:
        await admin.close()
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(ctl.stop(), "controller.stop")


# ---- requests ----------------------------------------------------------------------------------


async def test_poison_requests_end_and_a_request_delivered_too_often_ends_dead_letter(
        url: str, auth: LocalAuth, tmp_path: Path) -> None:
    admin_log = await JetStreamEventLog.open(url, creds=auth.role("admin"), ensure=False)
    model = checkpoint(tmp_path, "known")
    await admin_log.append([E.ModelRegistered(event_id="reg", ts=datetime.now(UTC), actor="test", model_key=model,
                                              checkpoint=str(tmp_path / "known"), size_bytes=GB)], None)
    tok = model_token(model)
    alice = auth.role("client:alice")
    mallory = await as_user(url, alice)
    js = mallory.jetstream()
    ack_wait = 0.5
    kv = await admin_log.js.key_value(REQUEST_STATUS_BUCKET)

    async def kept(rid: str) -> Any:
        async with asyncio.timeout(20):
            while True:
                try:
                    u = status_decoder.decode((await kv.get(status_key(rid, "alice"))).value)
                    if u.terminal:
                        return u
                except nats.js.errors.KeyNotFoundError:
                    pass
                await asyncio.sleep(0.05)

    # A request delivered REQUEST_MAX_DELIVER - 1 times already (each time its dispatcher "died"):
    # the dispatcher's consumer, as it makes it, pulled and never acked by the test.
    from nats.js import api

    ok = Request(request_id="tired", model_key=model, payload={"op": "forward", "input_ids": [[1]]},
                 submitted_at=datetime.now(UTC))
    await js.publish(request_subject(model, "alice"), encoder.encode(ok), headers={"Nats-Msg-Id": request_msg_id("tired", alice)})
    durable = request_consumer(tok, request_partition("alice"))  # alice's partition's, as the dispatcher makes it
    cfg = api.ConsumerConfig(durable_name=durable, filter_subjects=request_consumers(tok)[durable],
                             ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait, max_deliver=REQUEST_MAX_DELIVER,
                             max_ack_pending=100_000, deliver_policy=api.DeliverPolicy.ALL)
    await admin_log.js.add_consumer(REQUESTS_STREAM, cfg)
    sub = await admin_log.js.pull_subscribe_bind(durable=durable, stream=REQUESTS_STREAM)
    for n in range(1, REQUEST_MAX_DELIVER):
        (m,) = await sub.fetch(1, timeout=5)
        assert m.metadata.num_delivered == n
        await asyncio.sleep(ack_wait + 0.2)  # not acked: the server redelivers it
    await sub.unsubscribe()

    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher"), ack_wait_s=ack_wait).start()
    try:
        u = await kept("tired")
        assert u.error == "DeadLetter" and f"delivered {REQUEST_MAX_DELIVER} times" in u.message, u
        info = await admin_log.js.consumer_info(REQUESTS_STREAM, durable)
        assert info.config.max_deliver == REQUEST_MAX_DELIVER

        # Poison bodies on alice's own request subject of the (now consumed) model: each ends.
        bodies = {"nested": b'{"payload":{"a":' + POISON_NESTED + b"}}", "utf8": b'{"request_id":"\xff\xfe","model_key":"m"}',
                  "deep-key": encoder.encode(Request(request_id="deep-key", model_key='C:{"repo_id": ' + "[" * 3000
                                                     + "]" * 3000 + "}", payload={}, submitted_at=datetime.now(UTC)))}
        for rid, body in bodies.items():
            await js.publish(request_subject(model, "alice"), body, headers={"Nats-Msg-Id": request_msg_id(rid, alice)})
            u = await kept(rid)
            assert u.status.value == "ERROR" and u.error == "InvalidCommand" and u.message, u
        # No id a status could be kept under, in body or header: terminated, never redelivered.
        await js.publish(request_subject(model, "alice"), b'{"request_id": "not a key!"}',
                         headers={"Nats-Msg-Id": "alice.x.also not a key"})
        async with asyncio.timeout(20):
            while (await admin_log.js.stream_info(REQUESTS_STREAM)).state.messages:
                await asyncio.sleep(0.05)
        # bob's request for the same model is taken at once (no replica runs here: it waits for one).
        async with Client(url, creds=auth.role("client:bob")) as bob:
            job = await bob.submit(model, {"op": "forward", "input_ids": [[1]]})
            async with asyncio.timeout(20):
                while (k := await job.latest()) is None or k.status.value == "RECEIVED":
                    await asyncio.sleep(0.05)
            assert not k.terminal, k
            await job.close()
    finally:
        await mallory.close()
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(ctl.stop(), "controller.stop")
        await admin_log.close()


@pytest.fixture(autouse=True)
def _no_host_model_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NDIF_INVENTORY", raising=False)
    assert os.environ.get("NDIF_MODEL_ROOTS")  # tests/conftest.py: the tests' temp dirs (overridden above)


def test_the_poison_bodies_are_what_the_issue_says() -> None:
    assert len(POISON_NESTED) == 6000 and len(POISON_UTF8) == 36
    with pytest.raises(MSGSPEC_BAD_UTF8):
        msgspec.json.decode(POISON_UTF8)
    got = decode_any(POISON_UTF8, limit=1 << 20, what="request")
    assert isinstance(got, Refused) and got.reason.startswith("request refused: not UTF-8"), got


async def test_an_unreadable_kept_status_is_no_terminal_one(url: str, auth: LocalAuth, tmp_path: Path) -> None:
    """What a write through someone else's reply could leave in a user's kept status (planted here by the
    admin: closing that path is the accounts' part): the dispatcher reads it as no status and ends the
    request over it, instead of failing on it (and the request being redelivered forever)."""
    admin_log = await JetStreamEventLog.open(url, creds=auth.role("admin"), ensure=False)
    model = checkpoint(tmp_path, "known")
    await admin_log.append([E.ModelRegistered(event_id="reg", ts=datetime.now(UTC), actor="test", model_key=model,
                                              checkpoint=str(tmp_path / "known"), size_bytes=GB)], None)
    kv = await admin_log.js.key_value(REQUEST_STATUS_BUCKET)
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
    alice = auth.role("client:alice")
    mallory = await as_user(url, alice)
    try:
        for rid, junk in (("junk-1", b'{"x":' + POISON_NESTED + b"}"), ("junk-2", b"\xff\xfe not a status")):
            await kv.put(status_key(rid, "alice"), junk)
            await mallory.jetstream().publish(request_subject(model, "alice"), b'{"payload":{"a":' + POISON_NESTED + b"}}",
                                              headers={"Nats-Msg-Id": request_msg_id(rid, alice)})
            async with asyncio.timeout(20):
                while True:
                    value = (await kv.get(status_key(rid, "alice"))).value
                    if value != junk:
                        break
                    await asyncio.sleep(0.05)
            u = status_decoder.decode(value)
            assert u.status.value == "ERROR" and u.error == "InvalidCommand", u
        async with asyncio.timeout(20):
            while (await admin_log.js.stream_info(REQUESTS_STREAM)).state.messages:
                await asyncio.sleep(0.05)
    finally:
        await mallory.close()
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(ctl.stop(), "controller.stop")
        await admin_log.close()
