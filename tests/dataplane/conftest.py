"""Shared by the Ray test modules: actor cleanup, tiny checkpoints and the service (controller, agent,
dispatcher) the request-path tests run against (the local Ray itself: tests/conftest.py `local_ray`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.runtime import ray_adapter
from dataplane.runtime.ray_adapter import get_actor, list_replica_actors
from dataplane.serving.dispatcher import Dispatcher
from tests.checkpoints import TinyModels
from tests.conftest import bounded, fresh_event_log

GB = 10**9


def kill_all_actors() -> None:
    for mk, rid, _ in list_replica_actors():
        h = get_actor(mk, rid)
        if h is not None:
            ray_adapter.kill_actor(h)


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"gpt2": tiny_models.gpt2(root / "gpt2"), "llama": tiny_models.llama(root / "llama")}


@contextlib.asynccontextmanager
async def running_service(url: str, gcs: str, *, drain_timeout_s: float) -> AsyncIterator[dict[str, Any]]:
    """Controller + agent (node-a, 2 declared 80 GB GPUs) + dispatcher on fresh streams; yields the parts."""
    kill_all_actors()
    lg: JetStreamEventLog = await fresh_event_log(url)
    ctl = await Controller.from_url(url, policy_interval_s=0.2).start()
    agent = await (await NodeAgent.open(url, "node-a", gpus=declared_gpus(2, 80 * GB), cpu_cache_bytes=10 * GB,
                            heartbeat_s=0.5, drain_timeout_s=drain_timeout_s, health_interval_s=0.5)).start()
    disp = await Dispatcher.from_url(url).start()
    admin = await AdminClient.open(url, timeout=30)
    try:
        yield {"url": url, "controller": ctl, "agent": agent, "dispatcher": disp, "admin": admin, "log": lg,
               "gcs": gcs}
    finally:
        await bounded(admin.close(), "admin.close")
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(agent.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")
        await bounded(lg.close(), "log.close")
        kill_all_actors()
