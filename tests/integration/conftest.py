"""Fixtures shared by the control-plane integration tests: a tiny checkpoint, a fresh event log, an admin client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controlplane.ops.auth import LocalAuth, ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log


@pytest.fixture(scope="module")
def tiny(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.gpt2(tmp_path_factory.mktemp("ckpt") / "tiny-gpt2")


@pytest_asyncio.fixture
async def log(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamEventLog]:
    lg = await fresh_event_log(nats_server.url)
    yield lg
    await lg.close()


@pytest_asyncio.fixture
async def admin(nats_server: EmbeddedNats, log: JetStreamEventLog) -> AsyncIterator[AdminClient]:
    async with await AdminClient.open(nats_server.url, timeout=20) as a:
        yield a


NODE_A, NODE_B = "node-a.cluster", "node-b.cluster"  # the attack tests' two nodes


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> LocalAuth:
    """Users for two nodes (node-a.cluster, node-b.cluster) and two clients (alice, bob), made as
    `ndif up` makes them: the attack tests' accounts (a module may override it)."""
    return ensure_local([NODE_A, NODE_B], clients=["alice", "bob"],
                        home=tmp_path_factory.mktemp("home"))
