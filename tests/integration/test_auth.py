"""Roles enforced by a real nats-server run with the config `ndif up` generates (controlplane/ops/auth.py).

Every forgery is attempted with a client's credentials and must be refused by the
server (a permissions violation, and nothing changed); a table checks each role can do its job and
nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import pytest_asyncio

from controlplane.ops.auth import LocalAuth, ensure_local, permissions, system_subject
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.credentials import request_msg_id, resolve
from controlplane.store.direct import read_object
from controlplane.store.eventstore import JetStreamEventLog, connect
from schemas import errors as errs
from schemas.events import GpuInfo, NodeJoined, NodeLost, ReplicaFailed, encode_event, event_headers, event_subject
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
    SNAPSHOTS_BUCKET,
    node_token,
    replica_call_subject,
    replica_logs_subject,
    request_subject,
    results_bucket,
    status_key,
    status_subject,
    stored_request_subject,
    user_statuses,
)
from tests.checkpoints import TinyModels
from tests.integration.conftest import NODE_A, NODE_B
from tests.integration.probe import Probe, Spy

pytestmark = pytest.mark.timeout(120)
MODEL = "openai-community/gpt2"


@pytest.fixture(scope="module")
def secured(auth: LocalAuth, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(tmp_path_factory.mktemp("nats"), config_file=auth.config_path)
    srv.start()
    yield srv
    srv.close()


@pytest_asyncio.fixture(scope="module")
async def streams(secured: EmbeddedNats, auth: LocalAuth) -> AsyncIterator[str]:
    lg = await JetStreamEventLog.open(secured.url, creds=auth.role("admin"))
    await lg.close()
    yield secured.url


def _env(actor: str) -> dict[str, Any]:
    return {"event_id": f"forged-{actor}-{datetime.now(UTC).timestamp()}", "ts": datetime.now(UTC), "actor": actor}


async def _last_seq(url: str, auth: LocalAuth, stream: str = EVENTS_STREAM) -> int:
    nc = await connect(url, creds=auth.role("admin"))
    try:
        return int((await nc.jetstream().stream_info(stream)).state.last_seq)
    finally:
        await nc.close()


# ---- forgeries, with a client's credentials ------------------------------------------------------


async def test_forged_observed_facts_are_refused(streams: str, auth: LocalAuth) -> None:
    before = await _last_seq(streams, auth)
    mallory = await Probe.open(streams, auth.role("client:alice"))
    try:
        forged = [
            ReplicaFailed(**_env(f"agent:{NODE_A}"), model_key=MODEL, replica_id=0, node_id=NODE_A, error="forged"),
            NodeLost(**_env("controller:x"), node_id=NODE_A),
            NodeJoined(**_env(f"agent:{NODE_B}"), node_id="ghost", gpus=(GpuInfo(index=0, memory_bytes=1),),
                       cpu_cache_bytes=1),
        ]
        for ev in forged:
            subject = event_subject(ev)
            assert not await mallory.can_publish(subject, encode_event(ev), headers=event_headers(ev)), subject
            # The old (userless) replica subject too.
            assert not await mallory.can_publish(f"ndif.evt.replica.{node_token(MODEL)}.0", encode_event(ev))
    finally:
        await mallory.close()
    assert await _last_seq(streams, auth) == before  # nothing appended


async def test_an_operators_command_id_cannot_be_taken(tiny_models: TinyModels, streams: str, auth: LocalAuth, tmp_path: Path) -> None:
    model = str(tiny_models.gpt2(tmp_path / "gpt2"))
    ctl = await Controller.from_url(streams, creds=auth.role("controller"), policy_interval_s=0.2).start()
    admin = await AdminClient.open(streams, timeout=10, creds=auth.role("admin"))
    mallory = await Probe.open(streams, auth.role("client:alice"))
    try:
        cid = "cmd-operators-own-0001"
        body = msgspec.json.encode({"type": "Deploy", "command_id": cid, "actor": "cli:mallory",
                                    "model_key": model, "replicas": 1})
        for verb in ("deploy", "scale", "evict", "undeploy"):
            assert not await mallory.can_publish(f"ndif.cmd.{verb}", body)
        res = await admin.deploy(model, 1, command_id=cid)
        # the operator's command ran: decided and appended (no node joined, so it placed nothing: ok is False)
        assert not res.duplicate and res.first_seq and res.error == "PlacementError" and res.asked == 1, res
    finally:
        await mallory.close()
        await admin.close()
        await ctl.stop()


async def test_a_client_reads_no_one_elses_prompts_or_statuses(streams: str, auth: LocalAuth) -> None:
    bob = await Probe.open(streams, auth.role("client:bob"))
    alice = await Probe.open(streams, auth.role("client:alice"))
    try:
        req = Request(request_id="bobs-secret", model_key=MODEL, payload={"prompt": "bob's secret"},
                      submitted_at=datetime.now(UTC))
        js = bob.nc.jetstream()
        ack = await js.publish(request_subject(MODEL, "bob"), encoder.encode(req), headers={"Nats-Msg-Id": "bob.x1"})
        assert ack.seq > 0  # a client may submit its own requests
        # Alice: the request stream (consumers, message gets, core subscriptions), others' statuses.
        assert not await alice.can_subscribe("ndif.req.>")
        assert not await alice.can_subscribe(request_subject(MODEL, "bob"))
        for api_subject in (f"$JS.API.CONSUMER.CREATE.{REQUESTS_STREAM}",
                            f"$JS.API.CONSUMER.DURABLE.CREATE.{REQUESTS_STREAM}.spy",
                            f"$JS.API.STREAM.MSG.GET.{REQUESTS_STREAM}", f"$JS.API.DIRECT.GET.{REQUESTS_STREAM}"):
            assert not await alice.can_publish(api_subject, b'{"seq": 1}'), api_subject
        assert not await alice.can_subscribe("ndif.status.>")
        assert not await alice.can_subscribe(status_subject("bobs-secret", "bob"))
        assert not await alice.can_subscribe("_INBOX.>")
        assert not await alice.can_subscribe("_INBOX_client-bob.>")
        assert not await alice.can_publish(
            f"$JS.API.DIRECT.GET.KV_{REQUEST_STATUS_BUCKET}.$KV.{REQUEST_STATUS_BUCKET}.bob.bobs-secret", b"")
        # Her own are hers.
        assert await alice.can_subscribe(status_subject("mine", "alice"))
        assert await alice.can_subscribe("_INBOX_client-alice.>")
    finally:
        await alice.close()
        await bob.close()


async def test_no_forged_status_reaches_a_victim(streams: str, auth: LocalAuth) -> None:
    admin_nc = await connect(streams, creds=auth.role("admin"))
    victim = await Probe.open(streams, auth.role("client:bob"))
    mallory = await Probe.open(streams, auth.role("client:alice"))
    try:
        got: list[bytes] = []

        async def on_status(m: Any) -> None:
            got.append(m.data)

        sub = await victim.nc.subscribe(status_subject("r1", "bob"), cb=on_status)
        await victim.nc.flush()
        forged = encoder.encode(StatusUpdate(request_id="r1", status=RequestStatus.COMPLETED, ts=datetime.now(UTC),
                                             result={"text": "forged"}, user="bob"))
        assert not await mallory.can_publish(status_subject("r1", "bob"), forged)  # core publish
        assert not await mallory.can_publish(status_subject("r1"), forged)  # the userless form
        assert not await mallory.can_publish(f"$KV.{REQUEST_STATUS_BUCKET}.{status_key('r1', 'bob')}", forged)  # KV put
        assert not await mallory.can_publish(f"$KV.{REQUEST_STATUS_BUCKET}.r1", forged)
        await asyncio.sleep(0.2)
        await sub.unsubscribe()
        assert got == []
        kv = await admin_nc.jetstream().key_value(REQUEST_STATUS_BUCKET)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(status_key("r1", "bob"))
    finally:
        await mallory.close()
        await victim.close()
        await admin_nc.close()


async def test_a_clients_jobs_share_one_subscription_to_its_users_statuses(streams: str, auth: LocalAuth) -> None:
    """A client with a user listens through one subscription, `ndif.status.<user>.>` (what its account
    imports), whatever the number of its jobs: each job still gets its own request's status only."""
    from dataplane.client import Client

    disp = await connect(streams, creds=auth.role("dispatcher"))
    try:
        async with Client(streams, creds=auth.role("client:alice")) as alice:
            jobs = [await alice.job(f"shared-{i}", MODEL) for i in range(3)]
            waits = [asyncio.ensure_future(j.result(timeout=10)) for j in jobs]
            async with asyncio.timeout(5):
                while len(alice._watching) < 3:  # each has read its kept status (none) and listens
                    await asyncio.sleep(0.01)
            status_subs = [x.subject for x in alice.log.nc._subs.values() if x.subject.startswith("ndif.status.")]
            assert status_subs == [user_statuses("alice")]
            for i in (2, 0, 1):
                u = StatusUpdate(request_id=f"shared-{i}", status=RequestStatus.COMPLETED, ts=datetime.now(UTC),
                                 result={"i": i}, user="alice")
                await disp.publish(status_subject(f"shared-{i}", "alice"), encoder.encode(u))
            assert await asyncio.gather(*waits) == [{"i": 0}, {"i": 1}, {"i": 2}]
            assert alice._watching == {}  # an ended job listens no more
    finally:
        await disp.close()


async def test_no_client_kills_anothers_request(streams: str, auth: LocalAuth) -> None:
    mallory = await Probe.open(streams, auth.role("client:alice"))
    try:
        assert not await mallory.can_publish("ndif.dispatcher.kill", b"bobs-request")  # an admin's kill
        assert not await mallory.can_publish("ndif.dispatcher.kill.bob", b"bobs-request")
        assert await mallory.can_publish("ndif.dispatcher.kill.alice", b"mine")  # only her own (checked by owner)
    finally:
        await mallory.close()


async def _streams_now(url: str, auth: LocalAuth) -> dict[str, tuple[int, int, dict[str, Any]]]:
    """Each stream a forger went for: (messages, last seq, config); NotFoundError when one is gone."""
    nc = await connect(url, creds=auth.role("admin"))
    try:
        out = {}
        for name in (EVENTS_STREAM, REQUESTS_STREAM, f"KV_{REQUEST_STATUS_BUCKET}"):
            info = await nc.jetstream().stream_info(name)
            out[name] = (info.state.messages, info.state.last_seq, info.config.as_dict())
        return out
    finally:
        await nc.close()


async def test_only_an_admin_deletes_or_changes_a_stream(streams: str, auth: LocalAuth) -> None:
    lg = await JetStreamEventLog.open(streams, creds=auth.role("admin"))
    try:  # something a purge would take away
        await lg.append([NodeLost(**_env("controller:test"), node_id="node-gone")], None)
    finally:
        await lg.close()
    before = await _streams_now(streams, auth)
    assert before[EVENTS_STREAM][0] > 0
    for who in ("client:alice", "dashboard", "controller", "dispatcher", f"agent:{NODE_A}"):
        p = await Probe.open(streams, auth.role(who))
        try:
            for op in ("DELETE", "UPDATE", "PURGE", "CREATE"):
                assert not await p.can_publish(f"$JS.API.STREAM.{op}.{EVENTS_STREAM}", b"{}"), (who, op)
            assert not await p.can_publish(f"$JS.API.STREAM.DELETE.{REQUESTS_STREAM}", b""), who
            assert not await p.can_publish(f"$JS.API.STREAM.DELETE.KV_{REQUEST_STATUS_BUCKET}", b""), who
        finally:
            await p.close()
    assert await _streams_now(streams, auth) == before  # each stream is there, as it was: same messages, same config


async def test_services_that_may_not_create_streams_say_so(tmp_path: Path, auth: LocalAuth) -> None:
    """On a server without streams, the controller (not an admin) reports them missing; it creates nothing."""
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        with pytest.raises(errs.InfrastructureError, match="may not create"):
            await JetStreamEventLog.open(srv.url, creds=auth.role("controller"))


async def test_a_deleted_event_stream_is_never_silently_recreated(tmp_path: Path, auth: LocalAuth) -> None:
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        lg = await JetStreamEventLog.open(srv.url, creds=auth.role("admin"))
        await lg.close()
        nc = await connect(srv.url, creds=auth.role("admin"))
        await nc.jetstream().delete_stream(EVENTS_STREAM)  # an admin may
        await nc.close()
        for role in ("admin", "controller"):
            with pytest.raises(errs.InfrastructureError, match=r"missing|does not exist"):
                await JetStreamEventLog.open(srv.url, creds=auth.role(role))
        # An operator's decision to start over is explicit.
        lg = await JetStreamEventLog.open(srv.url, creds=auth.role("admin"), ensure=False)
        await lg.ensure(start_new_history=True)
        assert await lg.last_seq() == 0
        await lg.close()


# ---- gaps closed after review: large results, request ids, replica endpoints, consumers ---------


async def test_a_clients_large_results_are_its_own(streams: str, auth: LocalAuth) -> None:
    """Results over the inline limit go to the owner's own bucket (`ndif_results_<user>`), which the
    dispatcher creates and only that client may read (by direct gets; no client may create a consumer,
    whose deliver subject permissions cannot see)."""
    import base64

    from dataplane.serving.jetstream import JetStreamResults

    body = msgspec.json.encode({"output_ids": [[123456] * 512] * 160})  # ~570 KiB: the dispatcher's large path
    assert len(body) > 256 * 1024
    name = f"{status_key('bobs-big', 'bob')}.json"
    lg = await JetStreamEventLog.open(streams, ensure=False, creds=auth.role("dispatcher"), role="dispatcher")
    # the dispatcher's results stores, as the dispatcher user (what `finish` puts a large result through)
    results = JetStreamResults(lg.js, await lg.js.object_store(RESULTS_BUCKET), replicas=lg.replicas)
    bob = await Probe.open(streams, auth.role("client:bob"))
    mallory = await Probe.open(streams, auth.role("client:alice"))
    try:
        await results.put("bob", name, body)  # what `finish` does with a large result
        # the SDK's read (Job.result), through its account's import of the JetStream API
        assert await read_object(bob.nc, results_bucket("bob"), name, api=bob.api) == body

        b = results_bucket("bob")
        meta = f"$O.{b}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        for api in ("$JS.API", mallory.api):  # the system's own API subjects, and hers as she imports them
            tried = [f"{api}.DIRECT.GET.OBJ_{b}.{meta}", f"{api}.DIRECT.GET.OBJ_{b}", f"{api}.STREAM.MSG.GET.OBJ_{b}",
                     f"{api}.CONSUMER.CREATE.OBJ_{b}", f"{api}.CONSUMER.CREATE.OBJ_{b}.spy.$O.{b}.C.>",
                     f"{api}.CONSUMER.DURABLE.CREATE.OBJ_{b}.spy", f"{api}.STREAM.INFO.OBJ_{b}",
                     # her own bucket: no consumer either (it could deliver anywhere)
                     f"{api}.CONSUMER.CREATE.OBJ_{results_bucket('alice')}",
                     # the shared bucket of an open server
                     f"{api}.DIRECT.GET.OBJ_{RESULTS_BUCKET}", f"{api}.CONSUMER.CREATE.OBJ_{RESULTS_BUCKET}"]
            for subject in tried:
                assert not await mallory.can_publish(subject, b'{"seq": 1, "batch": 10}'), subject
        assert not await mallory.can_subscribe(f"$O.{b}.>")
        assert not await mallory.can_publish(f"$O.{b}.M.x", b"{}")  # nor write into it
        for api in ("$JS.API", mallory.api):
            with pytest.raises(errs.InfrastructureTimeout):  # the SDK's own read, as her: nothing answers
                await read_object(mallory.nc, b, name, timeout=1.0, api=api)
        assert await read_object(bob.nc, b, name, api=bob.api) == body  # still there, unchanged
    finally:
        await mallory.close()
        await bob.close()
        await lg.close()


async def test_no_client_can_take_anothers_request_id_first(streams: str, auth: LocalAuth) -> None:
    """The request stream deduplicates by `Nats-Msg-Id` across users and permissions cannot check a
    header; the SDK's id is keyed by the owner's password, so one published first under any id an
    attacker can compute leaves the owner's request stored."""
    from dataplane.client import Client

    model = canonical_model_key("openai-community/gpt2-medium")  # this test's own subjects
    rid = "bobs-next-request"
    mallory = await Probe.open(streams, auth.role("client:alice"))
    admin = await connect(streams, creds=auth.role("admin"))
    try:
        js = mallory.nc.jetstream()
        squat = encoder.encode(Request(request_id=rid, model_key=model, payload={}, submitted_at=datetime.now(UTC)))
        for msg_id in (status_key(rid, "bob"), rid, f"bob.{'0' * 32}.{rid}", request_msg_id(rid, auth.role("client:alice"))):
            ack = await js.publish(request_subject(model, "alice"), squat, headers={"Nats-Msg-Id": msg_id})
            assert ack.seq > 0 and not ack.duplicate  # stored as hers: the server does not police headers
        assert not await mallory.can_publish(request_subject(model, "bob"), squat)  # nor under bob's name

        async def stored(user: str) -> int:
            subject = stored_request_subject(request_subject(model, user))  # under the user's partition
            info = await admin.jetstream().stream_info(REQUESTS_STREAM, subjects_filter=subject)
            return int((info.state.subjects or {}).get(subject, 0))

        async with Client(streams, creds=auth.role("client:bob")) as bob:
            job = await bob.submit(model, {"op": "forward", "input_ids": [[1]]}, request_id=rid)
            await job.close()
            assert await stored("bob") == 1  # bob's request is in the stream, not dropped as a duplicate
            job = await bob.submit(model, {"op": "forward", "input_ids": [[1]]}, request_id=rid)  # his own resend
            await job.close()
            assert await stored("bob") == 1  # ... is still stored once
        raw = await admin.jetstream().get_last_msg(REQUESTS_STREAM, stored_request_subject(request_subject(model, "bob")))
        assert msgspec.json.decode(raw.data)["request_id"] == rid
    finally:
        await mallory.close()
        await admin.close()


async def test_an_agent_serves_only_its_own_nodes_replicas(streams: str, auth: LocalAuth) -> None:
    """Replica endpoints are `ndif.run.<ntok>.<mtok>.<rid>`; node B's agent (and its actors, which
    connect as it) can neither listen on nor answer node A's replica calls."""
    a_subject = replica_call_subject(MODEL, 0, NODE_A)
    agent_a = await Probe.open(streams, auth.role(f"agent:{NODE_A}"))
    agent_b = await Probe.open(streams, auth.role(f"agent:{NODE_B}"))
    disp = await Probe.open(streams, auth.role("dispatcher"))
    try:
        intercepted: list[bytes] = []

        async def answer_a(m: Any) -> None:
            await m.respond(b"from node A")

        async def steal(m: Any) -> None:
            intercepted.append(m.data)
            await m.respond(b"forged by node B")

        sub_a = await agent_a.nc.subscribe(a_subject, cb=answer_a)
        await agent_a.nc.flush()
        for subject in (a_subject, f"ndif.run.{node_token(NODE_A)}.>", "ndif.run.>", "ndif.run.*.*.*",
                        f"ndif.run.{node_token(MODEL)}.0"):
            sub = await agent_b.nc.subscribe(subject, cb=steal)
            assert await agent_b._refused(f"Subscription to \"{subject}\""), subject
            await sub.unsubscribe()
        assert not await agent_b.can_publish(a_subject, b"[]")  # nor call another node's replicas
        answers = [(await disp.nc.request(a_subject, b"[]", timeout=2)).data for _ in range(5)]
        assert answers == [b"from node A"] * 5 and intercepted == []
        await sub_a.unsubscribe()
    finally:
        for p in (agent_a, agent_b, disp):
            await p.close()


async def test_the_dashboard_cannot_point_a_consumer_at_another_subject(streams: str, auth: LocalAuth) -> None:
    """A push consumer's deliver subject is in the request body, where permissions cannot look: the
    dashboard (and a node's agent) may create no consumer at all and reads the log by direct gets
    (its follower too)."""
    victim = await Probe.open(streams, auth.role("client:bob"))
    ctl = await Probe.open(streams, auth.role("controller"))
    dash = await Probe.open(streams, auth.role("dashboard"))
    try:
        got: list[bytes] = []

        async def on_msg(m: Any) -> None:
            got.append(m.data)

        await victim.nc.subscribe("ndif.status.bob.>", cb=on_msg)
        await ctl.nc.subscribe("ndif.cmd.*", cb=on_msg)  # what a controller listens on
        await victim.nc.flush()
        await ctl.nc.flush()
        for deliver in ("ndif.status.bob.hijack", "ndif.cmd.deploy"):
            cfg = msgspec.json.encode({"stream_name": EVENTS_STREAM, "config": {
                "deliver_subject": deliver, "deliver_policy": "all", "ack_policy": "none"}})
            for subject in (f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.x",
                            f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.x.ndif.evt.>",
                            f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS_STREAM}.x",
                            f"$JS.API.CONSUMER.CREATE.{REQUESTS_STREAM}",
                            f"$JS.API.CONSUMER.CREATE.KV_{HEARTBEATS_BUCKET}"):
                assert not await dash.can_publish(subject, cfg), (subject, deliver)
        await asyncio.sleep(0.3)
        assert got == []  # nothing delivered onto the victims' subjects
    finally:
        for p in (dash, ctl, victim):
            await p.close()

    agent = await Probe.open(streams, auth.role(f"agent:{NODE_B}"))  # a node's agent neither
    try:
        cfg = msgspec.json.encode({"stream_name": EVENTS_STREAM, "config": {"deliver_subject": "ndif.cmd.deploy"}})
        for subject in (f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}", f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.x.>",
                        f"$JS.API.CONSUMER.CREATE.KV_{HEARTBEATS_BUCKET}"):
            assert not await agent.can_publish(subject, cfg), subject
    finally:
        await agent.close()

    # Its job: the whole log, then new events as they come, without a consumer.
    admin = await JetStreamEventLog.open(streams, creds=auth.role("admin"), ensure=False)
    try:
        for who in ("dashboard", f"agent:{NODE_A}"):
            lg = await JetStreamEventLog.open(streams, creds=auth.role(who), ensure=False)
            try:
                assert lg.direct_reads
                want = [seq async for seq, _ in admin.read()]
                assert [seq async for seq, _ in lg.read()] == want
                follow = lg.follow_batches(len(want) + 1)
                nxt = asyncio.ensure_future(follow.__anext__())
                ev = NodeLost(**_env("controller:test"), node_id=f"direct-read-test-{who}")
                res = await admin.append([ev], None)
                batch = await asyncio.wait_for(nxt, 5)
                assert [seq for seq, _ in batch] == [res.first_seq]
                await follow.aclose()  # type: ignore[attr-defined]
            finally:
                await lg.close()
    finally:
        await admin.close()


# ---- each role can do its job and nothing else ----------------------------------------------------

A, B = node_token(NODE_A), node_token(NODE_B)
M = node_token(MODEL)
S = f"KV_{REQUEST_STATUS_BUCKET}"
# (user, "pub"/"sub", subject, allowed), from role_permissions.txt
def _table() -> list[tuple[str, str, str, bool]]:
    names = {"A": A, "B": B, "M": M, "S": S, "NODE_A": NODE_A, "EVENTS_STREAM": EVENTS_STREAM, "FACTS_STREAM": FACTS_STREAM, "REFUSED_STREAM": REFUSED_STREAM,
             "REQUESTS_STREAM": REQUESTS_STREAM, "HEARTBEATS_BUCKET": HEARTBEATS_BUCKET,
             "REQUEST_STATUS_BUCKET": REQUEST_STATUS_BUCKET, "RESULTS_BUCKET": RESULTS_BUCKET,
             "SNAPSHOTS_BUCKET": SNAPSHOTS_BUCKET, "call_A": replica_call_subject(MODEL, 0, NODE_A), "call_B": replica_call_subject(MODEL, 0, NODE_B),
             "logs_A": replica_logs_subject(NODE_A, MODEL, 0), "logs_B": replica_logs_subject(NODE_B, MODEL, 0),
             **{f"results_{u}": results_bucket(u) for u in ("alice", "bob", "mallory")}}
    rows = []
    for line in (Path(__file__).parent / "role_permissions.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            user, kind, subject, verdict = line.split()
            assert kind in ("pub", "sub") and verdict in ("allow", "deny"), line
            rows.append((user.format(**names), kind, subject.format(**names), verdict == "allow"))
    return rows


TABLE = _table()


async def test_each_role_does_its_job_and_nothing_else(streams: str, auth: LocalAuth) -> None:
    """Each row: the user's permissions, and for an allowed one that it crosses the account boundary
    (a publish arrives in the system's account, a subscriber gets what is published there)."""
    wrong = []
    probes: dict[str, Probe] = {}
    spy = await Spy.open(streams, auth.role("admin"), [])
    try:
        for i, (user, kind, subject, allowed) in enumerate(TABLE):
            p = probes.get(user) or await Probe.open(streams, auth.role(user))
            probes[user] = p
            marker = msgspec.json.encode({"matrix_row": i})
            if kind == "pub":
                arrives_as = system_subject(subject)
                await spy.watch(arrives_as)
                got = await p.can_publish(subject, marker)
                if got and allowed and not await spy.saw(arrives_as, marker):
                    wrong.append((user, kind, subject, "permitted, but nothing arrived in the system's account"))
                    continue
            else:
                seen: list[bytes] = []

                async def cb(m: Any, seen: list[bytes] = seen) -> None:
                    seen.append(m.data)

                sub = await p.nc.subscribe(subject, cb=cb)
                got = not await p._refused(f"Subscription to \"{subject}\"")
                if got and allowed:
                    await spy.nc.publish(subject.replace(">", "x").replace("*", "x"), marker)
                    await spy.nc.flush()
                    for _ in range(150):  # up to 3 s
                        if marker in seen:
                            break
                        await asyncio.sleep(0.02)
                    if marker not in seen:
                        wrong.append((user, kind, subject, "permitted, but nothing from the system's account came"))
                await sub.unsubscribe()
                if got and allowed:
                    continue
            if got != allowed:
                wrong.append((user, kind, subject, "allowed" if got else "refused"))
    finally:
        for p in probes.values():
            await p.close()
        await spy.close()
    assert wrong == []


def test_credentials_are_private_and_kept(auth: LocalAuth) -> None:
    d = auth.config_path.parent
    assert (d.stat().st_mode & 0o777) == 0o700
    for f in d.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o600, f
    again = ensure_local([NODE_A, NODE_B], clients=["alice", "bob"], home=d.parent)
    assert again.role("admin") == auth.role("admin")  # made once, then reused


def test_local_commands_find_their_role(auth: LocalAuth, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NDIF_HOME", str(auth.config_path.parent.parent))
    monkeypatch.delenv("NDIF_CREDS", raising=False)
    monkeypatch.setenv("NDIF_CLIENT_NAME", "alice")
    assert resolve("admin", url="nats://127.0.0.1:4222") == auth.role("admin")
    assert resolve("client", url="nats://127.0.0.1:4222") == auth.role("client:alice")
    assert resolve("agent", url="nats://127.0.0.1:4222", node_id=NODE_B) == auth.role(f"agent:{NODE_B}")
    assert resolve("admin", url="nats://nats.example.org:4222") is None  # never sent to a remote server
    assert permissions("admin")["publish"]["allow"] == [">"]


async def test_no_credentials_no_connection(streams: str) -> None:
    with pytest.raises(errs.InfrastructureError, match="requires a user and none was found"):
        await connect(streams, creds=None)


@pytest.mark.parametrize("conf", ["n1.conf", "n2.conf", "n3.conf"])
def test_the_cluster_configs_take_the_generated_users(conf: str, auth: LocalAuth, tmp_path: Path) -> None:
    import shutil
    import subprocess

    from controlplane.ops.nats_server import find_nats_server

    deploy = Path(__file__).resolve().parents[2] / "deploy" / "nats"
    shutil.copy(deploy / conf, tmp_path / conf)
    shutil.copy(auth.config_path, tmp_path / "ndif-auth.conf")
    ran = subprocess.run([find_nats_server(), "-c", str(tmp_path / conf), "-t"], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    (tmp_path / "ndif-auth.conf").unlink()  # without the users the config does not start: nothing runs open
    ran = subprocess.run([find_nats_server(), "-c", str(tmp_path / conf), "-t"], capture_output=True, text=True)
    assert ran.returncode != 0


# ---- snapshots: the controller writes them, every reader starts from them ------------------------------


async def test_the_controller_writes_snapshots_and_each_role_that_folds_starts_from_them(streams: str,
                                                                                        auth: LocalAuth) -> None:
    """As the users of a server with users: the controller stores a snapshot (object put, replace,
    delete); the agent, dispatcher and dashboard list and read it by direct gets and fold from it;
    a client may not read it, and no reader may write one."""
    from structlog.testing import capture_logs

    from controlplane.core.projections import ClusterState
    from controlplane.service.factgate import fact_gate
    from controlplane.service.snapshots import SnapshotWriter
    from controlplane.store.rebuild import rebuild

    ctl = await JetStreamEventLog.open(streams, creds=auth.role("controller"), ensure=False)
    try:
        before = await ctl.last_seq()
        node = await JetStreamEventLog.open(streams, creds=auth.role(f"agent:{NODE_A}"), ensure=False)
        try:
            async with fact_gate(ctl):  # the gate, as the controller's user, admits it from NDIF_FACTS
                await node.append([NodeJoined(**_env(f"agent:{NODE_A}"), node_id=NODE_A, cpu_cache_bytes=1,
                                              gpus=(GpuInfo(index=0, memory_bytes=1),))], None)
        finally:
            await node.close()
        assert await ctl.last_seq() == before + 1
        state = await rebuild(ctl)
        writer = SnapshotWriter(ctl, every=1, every_s=0, keep=1)
        first = await writer.write_now(state)
        await writer.write_now(state)  # the same name again: replaced
        assert first in await ctl.snapshot_names()
        for role in ("agent:" + NODE_A, "dispatcher", "dashboard"):
            lg = await JetStreamEventLog.open(streams, creds=auth.role(role), ensure=False)
            try:
                with capture_logs() as logs:
                    got = await rebuild(lg)
                assert got == state and got != ClusterState(), role
                assert [e["snapshot"] for e in logs if e["event"] == "fold_rebuilt"] == [first], (role, logs)
                with pytest.raises(Exception):  # noqa: B017 - refused by the server, whatever nats-py makes of it
                    await asyncio.wait_for(lg.save_snapshot("cluster.v2.000000000001.t-", b"forged"), 5)
            finally:
                await lg.close()
        client = await Probe.open(streams, auth.role("client:alice"))
        try:
            assert not await client.can_publish(f"$JS.API.DIRECT.GET.OBJ_{SNAPSHOTS_BUCKET}")
        finally:
            await client.close()
        await ctl.delete_snapshot(first)
        assert first not in await ctl.snapshot_names()
    finally:
        await ctl.close()
