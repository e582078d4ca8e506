"""One user's share of what everyone shares, tried with a researcher's real credentials on a real
nats-server run with the config `ndif up` generates (docs/reliability.md "What one user can take").

- one checkpoint is one model: keys that differ only in what a load ignores (a revision on a
  directory, extra fields, another class) are refused, through the SDK and on the raw subject, and
  a second path to a registered checkpoint (a link) is refused as that model's twin; none of them
  registers, deploys or appends anything;
- a deploy her requests ask for takes free room only (the operator's replica stays) and her share
  of such models is bounded (`OnDemandRefused`, saying what to ask the operator);
- her kept large results are bounded in bytes and age: past the limit her request ends
  `StorageFull` with the limit, and another user's results are stored as before.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
import pytest_asyncio

from controlplane.ops.auth import AccountLimits, LocalAuth, ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.service.registry import ModelRoots
from controlplane.store.admin import AdminClient
from controlplane.store.credentials import request_msg_id
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client, RequestFailed
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.serving.dispatcher import Dispatcher
from dataplane.serving.jetstream import JetStreamStatusKV
from dataplane.serving.ports import StorageFull
from schemas import errors as errs
from schemas import events as E
from schemas.keys import DEFAULT_MODEL_CLASS, canonical_model_key, display_name
from schemas.status import ReplicaState, RequestStatus
from schemas.subjects import request_subject, user_statuses
from tests.checkpoints import TinyModels
from tests.conftest import bounded
from tests.fake_runtime import FakeCaller, FakeRuntime
from tests.integration.probe import raw_connect
from tests.waiting import until_state

pytestmark = pytest.mark.timeout(180)
NODE = "node-s"
GB = 10**9


@pytest.fixture
def auth(tmp_path: Path) -> LocalAuth:
    return ensure_local([NODE], clients=["alice", "bob"], home=tmp_path / "home")


@pytest_asyncio.fixture
async def url(auth: LocalAuth, tmp_path: Path) -> AsyncIterator[str]:
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        lg = await JetStreamEventLog.open(srv.url, creds=auth.role("admin"))  # what `ndif up` does first
        await lg.close()
        yield srv.url


def _key(repo: str, **fields: object) -> str:
    return f"{fields.pop('cls', DEFAULT_MODEL_CLASS)}:{json.dumps({'repo_id': repo, 'revision': None, **fields})}"


async def test_aliases_of_one_checkpoint_are_refused_and_append_nothing(tiny_models: TinyModels, url: str,
                                                                        auth: LocalAuth, tmp_path: Path) -> None:
    root = tmp_path / "models"
    tiny = tiny_models.gpt2(root / "tiny")
    (root / "link").symlink_to(tiny, target_is_directory=True)
    offered = canonical_model_key(str(tiny))
    aliases = [_key(str(tiny), revision="x1"), _key(str(tiny), note="x" * 4000), _key(str(tiny), cls="my.Other")]
    ctl = await Controller.from_url(url, creds=auth.role("controller"), model_roots=ModelRoots((str(root),))).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
    admin = await AdminClient.open(url, timeout=30, creds=auth.role("admin"))
    creds = auth.role("client:alice")
    try:
        async with Client(url, creds=creds) as alice:
            job = await alice.submit(offered, {"op": "forward", "input_ids": [[1]]})  # deployed for her request
            await until_state(admin, lambda s: offered in s.models and s.models[offered].registration is not None)
            await job.close()
            before = await admin.log.last_seq()
            for alias in aliases:  # the SDK refuses before sending
                with pytest.raises(errs.InvalidCommand, match=r"revision|not read by a load|not served"):
                    await alice.submit(alias, {"op": "forward", "input_ids": [[1]]})
            nc = await raw_connect(url, **creds.connect_options())
            try:
                for alias in aliases:  # and the front door refuses what is sent by hand
                    rid = f"alias-{uuid.uuid4().hex[:8]}"
                    body = msgspec.json.encode({"request_id": rid, "model_key": alias, "payload": {"op": "forward"},
                                                "submitted_at": datetime.now(UTC).isoformat()})
                    await nc.jetstream().publish(request_subject(alias, "alice"), body,
                                                 headers={"Nats-Msg-Id": request_msg_id(rid, creds)})
                    with pytest.raises(RequestFailed) as exc:
                        await (await alice.job(rid)).result(timeout=30)
                    assert exc.value.error == "InvalidCommand", exc.value
            finally:
                await nc.close()
            twin = await alice.submit(str(root / "link"), {"op": "forward", "input_ids": [[1]]})
            with pytest.raises(RequestFailed) as exc:
                await twin.result(timeout=30)
            assert exc.value.error == "InvalidCommand" and "one checkpoint is one model" in str(exc.value), exc.value
            assert f"use {tiny}" in str(exc.value)
        state = await admin.state()
        assert set(state.models) == {offered}
        # No event for any alias (the offered model's provisioning may still be trying for room).
        assert {e.model_key async for _, e in admin.log.read(before + 1)} <= {offered}
        with pytest.raises(errs.InvalidCommand, match="one checkpoint is one model"):
            await admin.deploy(str(root / "link"), 1)  # the operator's deploy is held to the same rule
    finally:
        await admin.close()
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(ctl.stop(), "controller.stop")


async def test_her_requests_take_free_room_only_and_a_bounded_share(tiny_models: TinyModels, url: str, auth: LocalAuth,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NDIF_ON_DEMAND_PER_USER", "1")
    root = tmp_path / "models"
    ops, first, second = (canonical_model_key(str(tiny_models.gpt2(root / n))) for n in ("ops", "first", "second"))
    ctl = await Controller.from_url(url, creds=auth.role("controller"), model_roots=ModelRoots((str(root),)),
                                    min_deploy_s=0).start()
    node = await (await NodeAgent.open(url, NODE, creds=auth.role(f"agent:{NODE}"), runtime=FakeRuntime(f"sim:{NODE}"),
                                       gpus=declared_gpus(1, GB), cpu_cache_bytes=0, heartbeat_s=0.3,
                                       health_interval_s=0.3, drain_timeout_s=0.0)).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
    admin = await AdminClient.open(url, timeout=30, creds=auth.role("admin"))
    try:
        await until_state(admin, lambda s: NODE in s.nodes)
        res = await admin.deploy(ops, 1, size_bytes=GB, headroom=0.0)  # the operator's model fills the card
        assert res.ok, res
        await until_state(admin, lambda s: any(r.model_key == ops and r.state is ReplicaState.AVAILABLE
                                               for r in s.replicas.values()))
        async with Client(url, creds=auth.role("client:alice")) as alice:
            job = await alice.submit(first, {"op": "forward", "input_ids": [[1]]})
            async for u in job.statuses(timeout=30):  # waits for room; it takes none
                if u.status is RequestStatus.PROVISIONING and "no room" in (u.message or ""):
                    break
            state = await admin.state()
            assert state.models[first].on_demand_for == "alice"
            assert [r.state for r in state.replicas.values() if r.model_key == ops] == [ReplicaState.AVAILABLE]
            assert not [e async for _, e in admin.log.read(1) if isinstance(e, E.ReplicaEvictionRequested)]
            # Her share is one model wanted at a time: the second is refused, saying what to ask.
            other = await alice.submit(second, {"op": "forward", "input_ids": [[1]]})
            with pytest.raises(RequestFailed) as exc:
                await other.result(timeout=30)
            assert exc.value.error == "OnDemandRefused", exc.value
            assert f"ndif deploy {display_name(second)}" in str(exc.value) and "NDIF_ON_DEMAND_PER_USER" in str(exc.value)
            assert second not in (await admin.state()).models
            await job.close()
    finally:
        await admin.close()
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(node.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


async def test_her_large_results_are_bounded_and_anothers_are_kept(tiny_models: TinyModels, url: str, auth: LocalAuth,
                                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NDIF_RESULTS_MAX_BYTES", str(700_000))  # two results of ~300 kB, not three
    monkeypatch.setenv("NDIF_RESULTS_MAX_AGE_S", "3600")
    model = canonical_model_key(str(tiny_models.gpt2(tmp_path / "models" / "m")))
    runtime = FakeRuntime(f"sim:{NODE}")
    ctl = await Controller.from_url(url, creds=auth.role("controller")).start()
    node = await (await NodeAgent.open(url, NODE, creds=auth.role(f"agent:{NODE}"), runtime=runtime,
                                       gpus=declared_gpus(1, 80 * GB), cpu_cache_bytes=0, heartbeat_s=0.3,
                                       health_interval_s=0.3, drain_timeout_s=0.0)).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher"), caller=FakeCaller([runtime])).start()
    admin = await AdminClient.open(url, timeout=30, creds=auth.role("admin"))
    big = {"op": "forward", "input_ids": [[1]], "blob": "x" * 300_000}  # echoed: a result over the inline limit
    try:
        await until_state(admin, lambda s: NODE in s.nodes)
        assert (await admin.deploy(model, 1, size_bytes=GB)).ok
        async with Client(url, creds=auth.role("client:alice")) as alice, \
                Client(url, creds=auth.role("client:bob")) as bob:
            for _ in range(2):
                assert (await (await alice.submit(model, big)).result(timeout=60))["echo"]["blob"] == big["blob"]
            with pytest.raises(RequestFailed) as exc:
                await (await alice.submit(model, big)).result(timeout=60)
            assert exc.value.error == "StorageFull" and "700000 bytes" in str(exc.value), exc.value
            assert (await (await bob.submit(model, big)).result(timeout=60))["echo"]["blob"] == big["blob"]
        info = await admin.log.js.stream_info("OBJ_ndif_results_alice")
        assert info.config.max_bytes == 700_000 and info.config.max_age == 3600
    finally:
        await admin.close()
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(node.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")


async def test_her_connections_and_subscriptions_are_bounded_and_another_user_connects(tmp_path: Path) -> None:
    """Her account holds at most NDIF_CLIENT_MAX_CONNECTIONS connections, each with at most
    NDIF_CLIENT_MAX_SUBSCRIPTIONS subscriptions (each to her statuses a copy of every status): past
    them the server refuses her, the SDK says which setting, and bob connects as before."""
    limits = AccountLimits.from_env({"NDIF_CLIENT_MAX_CONNECTIONS": "4", "NDIF_CLIENT_MAX_SUBSCRIPTIONS": "8"})
    auth = ensure_local([NODE], clients=["alice", "bob"], home=tmp_path / "home", limits=limits)
    alice, bob = auth.role("client:alice"), auth.role("client:bob")
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        lg = await JetStreamEventLog.open(srv.url, creds=auth.role("admin"))
        held: list[Any] = []
        try:
            held += [await raw_connect(srv.url, allow_reconnect=False, **alice.connect_options()) for _ in range(4)]
            with pytest.raises(nats.errors.Error, match="maximum account active connections"):
                held.append(await raw_connect(srv.url, allow_reconnect=False, **alice.connect_options()))
            with pytest.raises(errs.QuotaExceeded, match="NDIF_CLIENT_MAX_CONNECTIONS"):
                async with Client(srv.url, creds=alice, timeout=5):
                    pass
            async with Client(srv.url, creds=bob, timeout=5) as b:  # another account: untouched
                await b.log.nc.flush(timeout=5)
                assert b.log.nc.is_connected
            counts = []
            for n, nc in enumerate(held[:2]):  # per connection: each takes 8, the 9th is refused
                subscribed = 0
                for i in range(20):  # her own statuses, which she may read
                    if not nc.is_connected:
                        break
                    await nc.subscribe(f"{user_statuses('alice').removesuffix('>')}{n}.{i}")
                    subscribed += 1
                    with contextlib.suppress(nats.errors.Error):
                        await nc.flush(timeout=5)
                # the server refuses the 9th (and keeps the connection); nats-py closes it on that error
                assert "maximum subscriptions exceeded" in str(nc.last_error), nc.last_error
                counts.append(subscribed)
            assert counts == [9, 9], counts  # 8 kept and the refused 9th, on each
            async with Client(srv.url, creds=alice, timeout=5) as a:  # within her limits she works again
                await a.log.nc.flush(timeout=5)
        finally:
            for c in held:
                with contextlib.suppress(Exception):
                    await c.close()
            await lg.close()


async def test_a_status_store_at_its_limit_is_storage_full_not_an_unknown_error(nats_server: EmbeddedNats) -> None:
    """The status port says StorageFull when JetStream refuses a write for want of room (here a
    bucket at its max_bytes; a full server store answers "insufficient resources", the same class),
    which the dispatcher turns into the request's honest end (tests/unit/test_dispatcher_memlog.py)."""
    nc = await nats.connect(nats_server.url)
    bucket = f"full_{uuid.uuid4().hex[:8]}"
    try:
        kv = JetStreamStatusKV(await nc.jetstream().create_key_value(bucket=bucket, max_bytes=20_000))
        with pytest.raises(StorageFull, match="status store is full"):
            for i in range(100):
                await kv.create(f"k{i}", b"x" * 1000)
        assert i > 5  # what fitted was kept
    finally:
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_key_value(bucket)
        await nc.close()
