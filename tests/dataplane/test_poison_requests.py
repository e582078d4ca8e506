"""No request blocks a model for other users: with alice's real credentials, poison requests are the
first ever sent for a model (6 KB of nested arrays; invalid UTF-8 inside a string), then bob's
request for it is served through a real replica (Ray); alice's end ERROR. Again once the model is
served: poison, then bob's next request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controlplane.ops.auth import LocalAuth, ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.credentials import request_msg_id
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client, RequestFailed
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.serving.dispatcher import Dispatcher
from schemas.keys import canonical_model_key
from schemas.subjects import REQUESTS_STREAM, request_subject
from tests.checkpoints import TinyModels
from tests.conftest import bounded
from tests.dataplane.conftest import kill_all_actors
from tests.integration.probe import raw_connect

pytestmark = pytest.mark.timeout(300)
GB = 10**9
NODE = "node-a"
POISONS = {"nested": b'{"payload":{"a":' + b"[" * 3000 + b"]" * 3000 + b"}}",  # 6 KB of nested arrays in the payload
           "utf8": b'{"model_key":"\xff\xfe"}'}  # invalid UTF-8 inside a string


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> LocalAuth:
    return ensure_local([NODE], clients=["alice", "bob"], home=tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def secured(auth: LocalAuth, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats"), config_file=auth.config_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_models.gpt2(tmp_path_factory.mktemp("ckpt") / "gpt2"))  # before the services hold the loop


@pytest_asyncio.fixture
async def stack(secured: EmbeddedNats, auth: LocalAuth, local_ray: str) -> AsyncIterator[str]:
    kill_all_actors()
    url = secured.url
    lg = await JetStreamEventLog.open(url, creds=auth.role("admin"))
    await lg.close()
    ctl = await Controller.from_url(url, policy_interval_s=0.2, creds=auth.role("controller")).start()
    agent = await (await NodeAgent.open(url, NODE, gpus=declared_gpus(2, 80 * GB), cpu_cache_bytes=10 * GB,
                                        heartbeat_s=0.5, health_interval_s=0.5, creds=auth.role(f"agent:{NODE}"))).start()
    disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
    try:
        yield url
    finally:
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(agent.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")
        kill_all_actors()


async def poison(url: str, auth: LocalAuth, mk: str, tag: str) -> list[str]:
    """Alice's poison requests on her own subject of the model; their request ids."""
    alice = auth.role("client:alice")
    nc: Any = await raw_connect(url, **alice.connect_options())
    try:
        for rid, body in POISONS.items():
            await nc.jetstream().publish(request_subject(mk, "alice"), body,
                                         headers={"Nats-Msg-Id": request_msg_id(f"{rid}-{tag}", alice)})
    finally:
        await nc.close()
    return [f"{rid}-{tag}" for rid in POISONS]


async def test_a_poison_first_request_blocks_the_model_for_no_one(stack: str, auth: LocalAuth, model: str) -> None:
    url, mk = stack, canonical_model_key(model)
    sent = await poison(url, auth, mk, "first")  # the first requests ever for this model
    async with Client(url, creds=auth.role("client:bob")) as bob, Client(url, creds=auth.role("client:alice")) as alice:
        res = await bob.run(model, {"op": "forward", "input_ids": [[1, 2, 3]]}, timeout=240)
        assert res["next_token_ids"]
        sent += await poison(url, auth, mk, "served")  # now on the served model's own consumer
        res = await bob.run(model, {"op": "forward", "input_ids": [[4, 5]]}, timeout=60)
        assert res["next_token_ids"]
        for rid in sent:  # alice's each ended, with the reason, under her own id
            job = await alice.job(rid, model)
            with pytest.raises(RequestFailed, match="InvalidCommand: request refused"):
                await job.result(timeout=30)
        admin = await JetStreamEventLog.open(url, creds=auth.role("admin"), ensure=False)
        try:
            assert (await admin.js.stream_info(REQUESTS_STREAM)).state.messages == 0  # nothing left queued
        finally:
            await admin.close()


def test_the_checkpoint_is_under_the_tests_model_roots(model: str) -> None:
    import os

    assert Path(model).resolve().is_relative_to(Path(os.environ["NDIF_MODEL_ROOTS"]).resolve())
