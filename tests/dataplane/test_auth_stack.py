"""The whole stack with users and permissions on (the config `ndif up` generates): controller, agent,
dispatcher and replica endpoints each as their role, the CLI as the admin, the SDK and `ndif submit`
as a client; nothing any of them does for its job is refused by the server, and one client cannot
touch another's request.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controlplane.ops.auth import LocalAuth, ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client, RequestFailed
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.serving.dispatcher import Dispatcher
from tests import cli_zygote
from tests.checkpoints import TinyModels
from tests.conftest import bounded
from tests.dataplane.conftest import kill_all_actors

pytestmark = pytest.mark.timeout(300)
GB = 10**9
NODE = "node-a"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def auth(home: Path) -> LocalAuth:
    return ensure_local([NODE], clients=["alice", "bob"], home=home)


@pytest.fixture(scope="module")
def secured(auth: LocalAuth, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats"), config_file=auth.config_path) as srv:
        yield srv


async def ndif_as(home: Path, url: str, *args: str, client: str = "alice") -> tuple[int, str, str]:
    """`ndif ARGS` as a local command: it finds its credentials under NDIF_HOME by itself."""
    env = {**os.environ, "NDIF_HOME": str(home), "NDIF_CLIENT_NAME": client, "NDIF_LOG_LEVEL": "WARNING"}
    env.pop("NDIF_CREDS", None)
    return await cli_zygote.run([*args, "--nats", url], env=env, timeout=120)


@pytest_asyncio.fixture
async def stack(secured: EmbeddedNats, auth: LocalAuth, home: Path, local_ray: str,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, Any]]:
    kill_all_actors()
    url = secured.url
    lg = await JetStreamEventLog.open(url, creds=auth.role("admin"))  # what `ndif up` does first, as the admin
    await lg.close()
    ctl = await Controller.from_url(url, policy_interval_s=0.2, creds=auth.role("controller")).start()
    agent = await (await NodeAgent.open(url, NODE, gpus=declared_gpus(2, 80 * GB), cpu_cache_bytes=10 * GB, heartbeat_s=0.5,
                            health_interval_s=0.5, creds=auth.role(f"agent:{NODE}"))).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
    monkeypatch.setenv("NDIF_HOME", str(home))  # the SDK's default credentials: this machine's client
    monkeypatch.setenv("NDIF_CLIENT_NAME", "alice")
    monkeypatch.delenv("NDIF_CREDS", raising=False)
    try:
        yield {"url": url, "log_path": secured.store_dir / "nats-server.log"}
    finally:
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(agent.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")
        kill_all_actors()


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")  # made before the services start (it holds the event loop)
    return {"gpt2": str(tiny_models.gpt2(root / "gpt2")), "big": str(tiny_models.gpt2(root / "big")),
            "third": str(tiny_models.gpt2(root / "third"))}


async def test_the_whole_stack_runs_with_auth_on(models: dict[str, str], stack: dict[str, Any], auth: LocalAuth,
                                                 home: Path) -> None:
    url = stack["url"]
    model, big = models["gpt2"], models["big"]
    # Charged 46 GiB: it takes most of one card (74.5 GiB), so `big` below has no room now (though an empty node holds it).
    rc, out, err = await ndif_as(home, url, "deploy", model, "--replicas", "1", "--size-gib", "40", "--wait")
    assert rc == 0, (out, err)

    async with Client(url) as alice:  # the SDK's default: alice, from $NDIF_HOME
        assert alice.user == "alice"
        res = await alice.run(model, {"op": "forward", "input_ids": [[1, 2, 3]]}, timeout=120)
        assert res["next_token_ids"]
        # A result over the inline limit: the dispatcher puts it in alice's own bucket (ndif_results_alice),
        # and the SDK reads it with her rights (direct gets; a client may create no consumer).
        job = await alice.submit(model, {"op": "generate", "input_ids": [[1] * 64] * 1024, "max_new_tokens": 64})
        out = await job.result(timeout=120)
        assert job.last is not None and job.last.result_ref and job.last.result is None
        assert len(out["output_ids"]) == 1024 and len(out["output_ids"][0]) == 128
        # Her own request, stored under a dedup id that names another user (the server checks no
        # header; the id is stream-wide): the dispatcher ends it ERROR and says why.
        from datetime import UTC, datetime

        from schemas.keys import canonical_model_key
        from schemas.requests import Request, encoder
        from schemas.subjects import request_subject

        mk = canonical_model_key(model)
        body = encoder.encode(Request(request_id="named-bob", model_key=mk, payload={"op": "forward", "input_ids": [[1]]},
                                      submitted_at=datetime.now(UTC)))
        await alice.log.js.publish(request_subject(mk, "alice"), body, headers={"Nats-Msg-Id": f"bob.{'0' * 32}.named-bob"})
        with pytest.raises(RequestFailed, match="dedup id"):
            await (await alice.job("named-bob", model)).result(timeout=60)
    rc, out, err = await ndif_as(home, url, "submit", model, "--input-ids", "1,2", "--max-new-tokens", "2")
    assert rc == 0, (out, err)
    rc, out, err = await ndif_as(home, url, "queue", "--json")
    assert rc == 0, err
    procs = json.loads(out)["processors"]
    assert sum(p.get("endpoint_calls", 0) for p in procs) >= 1  # replicas served over NATS, as the agent's user

    # Bob's request waits on a model with no room now (a model no node could ever hold would end it at
    # once); Alice cannot kill it, Bob can. 100 GiB spans both cards, and one of them is mostly taken.
    rc, out, err = await ndif_as(home, url, "deploy", big, "--replicas", "1", "--size-gib", "100")
    assert "CANT_ACCOMMODATE" in out + err, (rc, out, err)
    async with Client(url, creds=auth.role("client:bob")) as bob, Client(url) as alice:
        job = await bob.submit(big, {"op": "forward", "input_ids": [[1]]})
        async with asyncio.timeout(30):
            while (k := await job.latest()) is None or str(k.status) == "RECEIVED":
                await asyncio.sleep(0.05)
        ans = await alice.kill(job.request_id)
        assert ans["ok"] is False
        assert not (await job.latest()).terminal  # type: ignore[union-attr]
        ans = await bob.kill(job.request_id)
        assert ans["ok"] is True, ans
        with pytest.raises(RequestFailed, match="cancelled"):
            await job.result(timeout=30)

    # Nothing any service did for its job was refused by the server.
    violations = [ln for ln in stack["log_path"].read_text().splitlines() if "Violation" in ln]
    assert violations == [], violations[:5]


async def test_undeploy_unknown_model_and_dashboard_with_auth_on(models: dict[str, str], stack: dict[str, Any],
                                                                 auth: LocalAuth, home: Path,
                                                                 tmp_path: Path) -> None:
    """The paths where two roles meet: a request for a model that cannot be deployed (the dispatcher's
    triage asks the controller, then ends and deletes the request), the dashboard as its read-only
    role (events, the dispatcher's state, the queue consumers), and `ndif undeploy` (the dispatcher
    removes the model's consumer). Nothing any of them does is refused by the server."""
    import aiohttp

    from controlplane.dashboard import Dashboard
    from schemas.subjects import REQUESTS_STREAM, model_token

    url = stack["url"]
    model = models["third"]  # its own model: the server (and its log) is the module's
    rc, out, err = await ndif_as(home, url, "deploy", model, "--replicas", "1", "--wait")
    assert rc == 0, (out, err)
    async with Client(url) as alice:
        assert (await alice.run(model, {"op": "forward", "input_ids": [[1, 2]]}, timeout=120))["next_token_ids"]
        # A model no one deployed, and no checkpoint there: triage's deploy is refused, the request ends.
        job = await alice.submit(str(tmp_path / "no-such-model"), {"op": "forward", "input_ids": [[1]]})
        with pytest.raises(RequestFailed):
            await job.result(timeout=60)

    async with Dashboard.from_url(url, port=0, creds=auth.role("dashboard"), queue_poll_s=0.2) as dash:
        async with aiohttp.ClientSession(headers=dash.auth_headers()) as http:
            for path in ("api/state", "api/events", "api/queues"):
                async with http.get(dash.base_url + path) as r:
                    assert r.status == 200, (path, await r.text())
            async with asyncio.timeout(30):
                while True:
                    async with http.get(dash.base_url + "api/queues") as r:
                        q = await r.json()
                    rows = [v for k, v in q["models"].items() if model in k]
                    if q["dispatcher"] and rows and rows[0].get("pending") is not None:
                        break
                    await asyncio.sleep(0.2)
            assert q["error"] is None, q

    rc, out, err = await ndif_as(home, url, "undeploy", model)
    assert rc == 0, (out, err)
    admin = await JetStreamEventLog.open(url, creds=auth.role("admin"), ensure=False)
    try:
        tok = model_token(next(k for k in q["models"] if model in k))
        async with asyncio.timeout(60):
            while f"proc-{tok}" in [c.name for c in await admin.js.consumers_info(REQUESTS_STREAM)]:
                await asyncio.sleep(0.2)
    finally:
        await admin.close()

    violations = [ln for ln in stack["log_path"].read_text().splitlines() if "Violation" in ln]
    assert violations == [], violations[:5]
