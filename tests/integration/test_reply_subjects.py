"""Reply-subject injection, tried from outside with each role's real credentials against a real
nats-server run with the config `ndif up` generates (controlplane/ops/auth.py).

nats-server delivers every answer (a JetStream API response, a publish ack, a direct get's messages,
a service's reply) to whatever reply subject the asker named, and checks that subject against no
permission. With every role in one account, a client, a node's agent or the dashboard could thereby
make the server write onto any subject a stream captures: another user's kept status, a request as
another user, the event log, a dead node's heartbeat, another user's results bucket, the admin's
kill subject. Each role outside the system's account now has an account of its own, where an answer
is delivered whatever the reply subject says; these tests show nothing reaches the system's account
that way, and that each role still gets its own answers. The SDK's and the dispatcher's own checks
(request id and user of a status, a kept status that is not one) are tested here too, with what
only the system's account could still deliver standing in for an attacker.

docs/reliability.md's attack table names each test.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio

from controlplane.ops.auth import LocalAuth
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.factgate import fact_gate
from controlplane.store.credentials import Creds
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client, RequestFailed
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.dispatcher.statuses import StatusWriter
from dataplane.serving.jetstream import JetStreamResults, JetStreamStatusKV
from dataplane.serving.processor import Pending
from schemas.events import GpuInfo, NodeJoined, encode_event
from schemas.keys import canonical_model_key
from schemas.requests import Request, StatusUpdate, encoder
from schemas.status import RequestStatus
from schemas.subjects import (
    EVENTS_STREAM,
    FACTS_STREAM,
    HEARTBEATS_BUCKET,
    REFUSED_STREAM,
    REQUEST_STATUS_BUCKET,
    REQUESTS_STREAM,
    RESULTS_BUCKET,
    model_token,
    node_token,
    request_subject,
    results_bucket,
    status_key,
    status_subject,
    stored_request_subject,
)
from tests.integration.probe import Probe, Spy, raw_connect
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)
NODE_A, NODE_B = "node-a.cluster", "node-b.cluster"  # node B is dead: it never beats
A, B = node_token(NODE_A), node_token(NODE_B)
MODEL = canonical_model_key("openai-community/gpt2")
ST = REQUEST_STATUS_BUCKET
BOB_RID = "bobs-request"
ALICE_RID = "alices-request"


@pytest.fixture(scope="module")
def server(auth: LocalAuth, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats"), config_file=auth.config_path) as srv:
        yield srv


def _req(rid: str, user: str) -> Request:
    return Request(request_id=rid, model_key=MODEL, payload={"op": "forward", "input_ids": [[1]]},
                   submitted_at=datetime.now(UTC), user=user)


async def _writer(url: str, auth: LocalAuth) -> tuple[StatusWriter, JetStreamEventLog]:
    """The dispatcher's status writer, as the dispatcher's user."""
    lg = await JetStreamEventLog.open(url, ensure=False, creds=auth.role("dispatcher"), role="dispatcher")
    w = StatusWriter(lg.nc.publish, JetStreamStatusKV(await lg.js.key_value(ST)),
                     JetStreamResults(lg.js, await lg.js.object_store(RESULTS_BUCKET), replicas=lg.replicas),
                     Background())
    return w, lg


@pytest_asyncio.fixture(scope="module")
async def url(server: EmbeddedNats, auth: LocalAuth) -> AsyncIterator[str]:
    """Streams made by the admin; node A's agent joined and beat; what alice owns, as the dispatcher
    made it: her request COMPLETED (its kept status) and her results bucket, holding a large result
    whose bytes are bob's request id and one that is a request body (a model's output is the user's to
    steer); bob's results bucket."""
    lg = await JetStreamEventLog.open(server.url, creds=auth.role("admin"))
    agent = await Probe.open(server.url, auth.role(f"agent:{NODE_A}"))
    try:
        async with fact_gate(lg) as gate:  # its NodeJoined admitted into the log, a junk fact refused
            for subject, body, _ in _asks(agent.creds)[:2]:  # its NodeJoined and a heartbeat
                await agent.nc.request(subject, body, timeout=5)
            await agent.nc.request(f"ndif.fact.node.{A}.{A}", b"junk", timeout=5)
            await until(lambda: gate.admitted == 1 and gate.refused == 1, timeout=10)
    finally:
        await agent.close()
        await lg.close()
    w, dlg = await _writer(server.url, auth)
    try:
        assert await w.finish(Pending(_req(ALICE_RID, "alice"), None), RequestStatus.COMPLETED,
                              result={"text": "alice's own data"})
        await w.results.put("alice", "kill.json", BOB_RID.encode())
        await w.results.put("alice", "req.json", encoder.encode(_req("runs-as-bob", "bob")))
        await w.results.put("bob", "bobs.json", b'{"text": "bob\'s large result"}')
    finally:
        await dlg.close()
    yield server.url


# ---- what each attacker may legitimately ask, and where it asks the answer to go ------------------------

TARGETS = {
    "bobs-kept-status": f"$KV.{ST}.{status_key(BOB_RID, 'bob')}",
    "bobs-live-status": status_subject(BOB_RID, "bob"),
    "the-admins-kill": "ndif.dispatcher.kill",
    "a-request-as-bob": request_subject(MODEL, "bob"),
    "bobs-results-bucket": f"$O.{results_bucket('bob')}.C.forged",
    "the-event-log": f"ndif.evt.model.{model_token(MODEL)}",
    "another-nodes-facts": f"ndif.fact.node.{B}.{B}",
    "a-dead-nodes-heartbeat": f"$KV.{HEARTBEATS_BUCKET}.{B}",
    "an-operators-command": "ndif.cmd.deploy",
}
# Where each target would be kept, if the server delivered there (a stream and its subject filter).
KEPT_IN = {
    "bobs-kept-status": f"KV_{ST}", "a-request-as-bob": REQUESTS_STREAM,
    "bobs-results-bucket": f"OBJ_{results_bucket('bob')}", "the-event-log": EVENTS_STREAM,
    "another-nodes-facts": FACTS_STREAM, "a-dead-nodes-heartbeat": f"KV_{HEARTBEATS_BUCKET}",
}
ATTACKERS = ["client:alice", f"agent:{NODE_A}", "dashboard"]


def _asks(c: Creds) -> list[tuple[str, bytes, bool]]:
    """(subject, body, answered without a dispatcher) for every request `c`'s role makes for its job."""
    api = c.js_api
    if c.role == "client":
        res = results_bucket("alice")
        meta = f"$O.{res}.M.{base64.urlsafe_b64encode(b'kill.json').decode()}"
        return [(request_subject(MODEL, "alice"), encoder.encode(_req("alices-next", "alice")), True),  # a publish ack
                (f"{api}.DIRECT.GET.KV_{ST}.$KV.{ST}.{status_key(ALICE_RID, 'alice')}", b"", True),  # her kept status
                (f"{api}.DIRECT.GET.OBJ_{res}", b'{"seq": 1, "batch": 1000}', True),  # her results bucket, all of it
                (f"{api}.DIRECT.GET.OBJ_{res}.{meta}", b"", True),
                ("ndif.dispatcher.kill.alice", ALICE_RID.encode(), False)]
    reads = [(f"{api}.DIRECT.GET.{EVENTS_STREAM}", b'{"seq": 1, "batch": 1000}', True),  # the whole log
             (f"{api}.DIRECT.GET.{EVENTS_STREAM}.ndif.evt.node.{A}.{A}", b"", True),
             (f"{api}.STREAM.INFO.{EVENTS_STREAM}", b"", True),
             (f"{api}.STREAM.MSG.GET.{EVENTS_STREAM}", b'{"seq": 1}', True)]
    if c.role == "agent":
        ev = NodeJoined(event_id=f"joined-{datetime.now(UTC).timestamp()}", ts=datetime.now(UTC), actor=f"agent:{NODE_A}",
                        node_id=NODE_A, gpus=(GpuInfo(index=0, memory_bytes=10**9),), cpu_cache_bytes=1)
        return [(f"ndif.fact.node.{A}.{A}", encode_event(ev), True),  # an append's publish ack (NDIF_FACTS)
                (f"$KV.{HEARTBEATS_BUCKET}.{A}", NODE_A.encode(), True),  # its heartbeat's ack
                (f"{api}.DIRECT.GET.{FACTS_STREAM}", b'{"seq": 1}', True),  # a fact read back
                (f"{api}.DIRECT.GET.{REFUSED_STREAM}.ndif.refused.{A}.2", b"", True),  # the gate's last refusal of it
                (f"{api}.DIRECT.GET.KV_{HEARTBEATS_BUCKET}.$KV.{HEARTBEATS_BUCKET}.{A}", b"", True), *reads]
    return [*reads, (f"{api}.CONSUMER.LIST.{REQUESTS_STREAM}", b"{}", True), ("ndif.dispatcher.state", b"", False)]


async def _kept(url: str, auth: LocalAuth) -> dict[str, tuple[int, int]]:
    """For each target's stream: how many messages it keeps on the target's subject, and the sequence
    of the last one (a KV bucket keeps one per key: a write shows in the sequence), as the admin."""
    nc = await raw_connect(url, **auth.role("admin").connect_options())
    try:
        js = nc.jetstream()
        out = {}
        for name, stream in KEPT_IN.items():
            subject = stored_request_subject(TARGETS[name]) if stream == REQUESTS_STREAM else TARGETS[name]
            info = await js.stream_info(stream, subjects_filter=subject)
            try:
                last = int((await js.get_msg(stream, subject=subject)).seq or 0)
            except nats.js.errors.NotFoundError:
                last = 0
            out[name] = (int((info.state.subjects or {}).get(subject, 0)), last)
        return out
    finally:
        await nc.close()


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("attacker", ATTACKERS)
async def test_no_answer_lands_outside_the_askers_account(url: str, auth: LocalAuth, attacker: str,
                                                          target: str) -> None:
    """Every request the attacker's role makes for its job, asked with the target as its reply
    subject: nothing arrives on the target in the system's account, nothing is kept there."""
    before = await _kept(url, auth)
    spy = await Spy.open(url, auth.role("admin"), [TARGETS[target]])
    p = await Probe.open(url, auth.role(attacker))
    try:
        for subject, body, _ in _asks(p.creds):
            await p.nc.publish(subject, body, reply=TARGETS[target])
        await p.nc.flush()
        got = await spy.settle(0.5)
        assert got == [], f"{len(got)} answers delivered onto {TARGETS[target]}: {got[:2]}"
    finally:
        await p.close()
        await spy.close()
    assert await _kept(url, auth) == before


@pytest.mark.parametrize("attacker", ATTACKERS)
async def test_each_role_still_gets_its_own_answers(url: str, auth: LocalAuth, attacker: str) -> None:
    p = await Probe.open(url, auth.role(attacker))
    try:
        for subject, body, answered in _asks(p.creds):
            if not answered:
                continue
            msg = await p.nc.request(subject, body, timeout=5)
            status = (msg.headers or {}).get("Status")
            assert status in (None, "204"), (subject, status)  # 204: the end of a batch with nothing in it
            assert b'"error"' not in msg.data[:200], (subject, msg.data[:200])
        assert p.errors == []
    finally:
        await p.close()


async def test_a_forged_result_never_becomes_another_users_result(url: str, auth: LocalAuth) -> None:
    """Alice has her own request's kept status (COMPLETED, her data) sent, by the direct get she may
    make, to bob's kept-status key and live status subject while bob waits for his request. Bob's SDK
    returns his own result, which the dispatcher keeps (its compare-and-set is not beaten)."""
    rid = "bobs-waited-for"
    w, dlg = await _writer(url, auth)
    alice = await Probe.open(url, auth.role("client:alice"))
    try:
        async with Client(url, creds=auth.role("client:bob"), timeout=5) as bob:
            job = await bob.submit(MODEL, {"op": "forward", "input_ids": [[1]]}, request_id=rid)
            mine = f"{alice.api}.DIRECT.GET.KV_{ST}.$KV.{ST}.{status_key(ALICE_RID, 'alice')}"
            for reply in (f"$KV.{ST}.{status_key(rid, 'bob')}", status_subject(rid, "bob")):
                for _ in range(3):
                    await alice.nc.publish(mine, b"", reply=reply)
            await alice.nc.flush()
            await asyncio.sleep(0.5)
            assert await w.finish(Pending(_req(rid, "bob"), None), RequestStatus.COMPLETED,
                                  result={"text": "bob's own result"})
            assert await job.result(timeout=10) == {"text": "bob's own result"}
        kept, _ = await w.kept(status_key(rid, "bob"))
        assert kept is not None and kept.request_id == rid and kept.user == "bob"
    finally:
        await alice.close()
        await dlg.close()


async def test_the_sdk_takes_only_its_own_statuses_and_results(url: str, auth: LocalAuth) -> None:
    """Whatever reaches a job's subject or key (here put there from the system's account, which no
    user outside it can do) counts only if it names the job's request id and user; a large result only
    if it is named after the job's own key."""
    rid, rid2 = "bobs-checked", "bobs-checked-ref"
    admin = await raw_connect(url, **auth.role("admin").connect_options())
    w, dlg = await _writer(url, auth)
    kv = await admin.jetstream().key_value(ST)

    def completed(request_id: str, user: str, **kw: Any) -> bytes:
        return encoder.encode(StatusUpdate(request_id=request_id, status=RequestStatus.COMPLETED,
                                           ts=datetime.now(UTC), user=user, **kw))

    try:
        async with Client(url, creds=auth.role("client:bob"), timeout=5) as bob:
            job = await bob.submit(MODEL, {"op": "forward", "input_ids": [[1]]}, request_id=rid)
            for body in (completed(ALICE_RID, "alice", result="alice's"), completed(rid, "alice", result="user"),
                         completed("other", "bob", result="id"), b"\xff" * 10, b"[" * 4000):
                await admin.publish(status_subject(rid, "bob"), body)
            await kv.put(status_key(rid, "bob"), completed(ALICE_RID, "alice", result="kept, not bob's"))
            await admin.flush()
            with pytest.raises(TimeoutError):  # none of them is bob's: the job waits on
                await job.result(timeout=3)
            assert job.last is None
            await kv.delete(status_key(rid, "bob"))
            assert await w.finish(Pending(_req(rid, "bob"), None), RequestStatus.COMPLETED, result={"text": "his"})
            assert await job.result(timeout=10) == {"text": "his"}

            # A terminal status of his own that points at another object than his key's.
            job2 = await bob.submit(MODEL, {"op": "forward", "input_ids": [[1]]}, request_id=rid2)
            await kv.put(status_key(rid2, "bob"), completed(rid2, "bob", result_ref="bobs.json"))
            with pytest.raises(RequestFailed) as failed:
                await job2.result(timeout=10)
            assert failed.value.error == "ResultNotOurs"
    finally:
        await dlg.close()
        await admin.close()


async def test_a_corrupt_kept_status_holds_no_request(url: str, auth: LocalAuth) -> None:
    """A kept status that is not one (junk, invalid UTF-8, nesting past the parser's depth) or names
    another request or user is no terminal status to the dispatcher: the request is not skipped as
    done and its real terminal status replaces it (not redelivered forever)."""
    admin = await raw_connect(url, **auth.role("admin").connect_options())
    w, dlg = await _writer(url, auth)
    kv = await admin.jetstream().key_value(ST)
    other = encoder.encode(StatusUpdate(request_id=ALICE_RID, status=RequestStatus.COMPLETED, ts=datetime.now(UTC),
                                        user="alice", result="alice's"))
    try:
        for i, junk in enumerate((b"not json", b'{"request_id": "\xff"}', b'{"result": ' + b"[" * 4000 + b"}", other)):
            rid = f"bobs-corrupted-{i}"
            key = status_key(rid, "bob")
            await kv.put(key, junk)
            assert await w.terminal(key) is None, junk[:40]
            assert await w.finish(Pending(_req(rid, "bob"), None), RequestStatus.ERROR, error="X", message="real")
            kept, _ = await w.kept(key)
            assert kept is not None and kept.request_id == rid and kept.status is RequestStatus.ERROR
    finally:
        await dlg.close()
        await admin.close()


@pytest.mark.parametrize("who", ["client:alice", "dashboard"])
async def test_no_one_lists_the_users_request_ids(url: str, auth: LocalAuth, who: str) -> None:
    """The status bucket's stream info, with a subjects filter, would list every user's request ids."""
    p = await Probe.open(url, auth.role(who))
    try:
        for api in ("$JS.API", p.api):
            subject = f"{api}.STREAM.INFO.KV_{ST}"
            try:
                msg = await p.nc.request(subject, b'{"subjects_filter": ">"}', timeout=1)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                msg = None
            assert msg is None or b"bobs" not in msg.data, (subject, msg.data[:300])
            assert await p._refused(f"Publish to \"{subject}\""), subject
    finally:
        await p.close()


async def test_the_server_refuses_a_config_that_imports_another_accounts_token(auth: LocalAuth,
                                                                               tmp_path: Any) -> None:
    """`account_token_position` on the system's exports: an account's import of another's token (a
    hand-edited config, a generator's mistake) keeps the server from starting."""
    import subprocess

    from controlplane.ops.nats_server import find_nats_server

    text = auth.config_path.read_text()
    for mine, theirs in (("ndif.req.*.alice", "ndif.req.*.bob"),
                         ("ndif.status.alice.>", "ndif.status.bob.>"),
                         (f"$KV.{HEARTBEATS_BUCKET}.{A}", f"$KV.{HEARTBEATS_BUCKET}.{B}")):
        assert f'"subject": "{mine}"' in text, mine
        bad = tmp_path / "bad.conf"
        bad.write_text(text.replace(f'"subject": "{mine}"', f'"subject": "{theirs}"', 1))
        ran = subprocess.run([find_nats_server(), "-c", str(bad), "-t"], capture_output=True, text=True)
        assert ran.returncode != 0 and "not authorized" in ran.stderr, (mine, ran.stderr)
    good = subprocess.run([find_nats_server(), "-c", str(auth.config_path), "-t"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
