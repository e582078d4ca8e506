"""`ndif up` writes each user's `nats` CLI context (`$NDIF_HOME/auth/nats-context/<user>.json`: url,
user, password, inbox_prefix, and jetstream_api_prefix outside the system's account), and a plain
nats-py connection made from those values alone (not our loader) does each role's job."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import nats
import pytest

from controlplane.ops.auth import ensure_local
from dataplane.node.agent import declared_gpus
from dataplane.ops.local import LocalCluster
from schemas.keys import canonical_model_key
from schemas.subjects import EVENTS_STREAM, request_subject

pytestmark = pytest.mark.timeout(60)
NODE = "node-ctx"


async def _connect(ctx: dict[str, str]) -> nats.NATS:
    return await nats.connect(ctx["url"], user=ctx["user"], password=ctx["password"],
                              inbox_prefix=ctx["inbox_prefix"].encode(), allow_reconnect=False, connect_timeout=5)


async def test_each_users_nats_context_connects_an_independent_client(tmp_path: Path) -> None:
    home = tmp_path / "home"
    auth = ensure_local([NODE], clients=["alice"], home=home)
    cluster = LocalCluster(store=tmp_path / "store", gpus=declared_gpus(1, 10**9), node_id=NODE, auth=auth,
                           dispatcher=False)
    cluster.start_nats()
    try:
        await cluster.ensure_log()
        d = home / "auth" / "nats-context"
        files = {p.stem: p for p in d.glob("*.json")}
        assert {"admin", "controller", "dispatcher", "dashboard", "client-alice"} <= set(files)
        for p in files.values():
            assert stat.S_IMODE(p.stat().st_mode) == 0o600
        admin = json.loads(files["admin"].read_text())
        assert admin["url"] == cluster.url and admin["user"] == "admin" and "jetstream_api_prefix" not in admin
        assert set(admin) <= {"description", "url", "user", "password", "inbox_prefix", "jetstream_api_prefix"}

        nc = await _connect(admin)
        try:
            info = await nc.jetstream().stream_info(EVENTS_STREAM)
            assert info.config.name == EVENTS_STREAM
        finally:
            await nc.close()

        alice = json.loads(files["client-alice"].read_text())
        assert alice["jetstream_api_prefix"] == "$JS.NDIF.API" and alice["inbox_prefix"] == "_INBOX_client-alice"
        nc = await _connect(alice)
        try:
            js = nc.jetstream(prefix=alice["jetstream_api_prefix"])
            model = canonical_model_key("openai-community/gpt2")
            ack = await js.publish(request_subject(model, "alice"), b"{}", headers={"Nats-Msg-Id": "ctx-test"})
            assert ack.seq >= 1  # the ack came back to alice's inbox prefix through the account's import
        finally:
            await nc.close()
    finally:
        await cluster.stop()
