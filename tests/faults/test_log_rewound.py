"""A log shorter than what its readers folded: the store restored from a backup (or a server that
lost its tail) under a live controller, node agent, dispatcher and dashboard. Each notices that the
log went back (LogRewound), folds it again, and acts on what it holds now: the agent kills the
replica the log no longer knows, and the cluster deploys and places again on the same store.

Real nats-server (stopped, its store swapped for the backup, started on the same port); the agent
runs over the in-memory runtime (tests/fake_runtime.py).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from controlplane.dashboard import Dashboard
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.node.agent import NodeAgent, declared_gpus
from dataplane.serving.dispatcher import Dispatcher
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState
from tests.conftest import bounded
from tests.fake_runtime import FakeRuntime
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GB = 10**9
NODE = "node-r"


def checkpoint(root: Path, name: str) -> str:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    return canonical_model_key(str(d))


async def test_every_reader_folds_again_when_the_log_goes_back(tmp_path: Path) -> None:
    store, backup = tmp_path / "nats", tmp_path / "backup"
    srv = EmbeddedNats(store).start()
    log = await JetStreamEventLog.open(srv.url)
    await log.close()
    srv.stop()  # the backup: the streams, nothing in them
    shutil.copytree(store, backup, ignore=shutil.ignore_patterns("ndif.lock"))
    srv.start()
    ctl = await Controller.from_url(srv.url, policy_interval_s=0.2).start()
    runtime = FakeRuntime(f"sim:{NODE}")
    agent = await (await NodeAgent.open(srv.url, NODE, runtime=runtime, gpus=declared_gpus(1, 80 * GB),
                                        cpu_cache_bytes=10 * GB, heartbeat_s=0.3, health_interval_s=0.3,
                                        drain_timeout_s=0.0)).start()
    disp = await Dispatcher.from_url(srv.url).start()
    dash = await Dashboard.from_url(srv.url, port=0).start()
    admin = await AdminClient.open(srv.url, timeout=10)
    try:
        await until(lambda: NODE in ctl.state.nodes, timeout=15)
        model = checkpoint(tmp_path, "m")
        res = await asyncio.wait_for(admin.deploy(model, 1, size_bytes=GB), 20)
        assert res.ok, res
        await until(lambda: (r := agent.state.replicas.get((model, 0))) is not None
                    and r.state is ReplicaState.AVAILABLE, timeout=15)
        await until(lambda: dash.model.seq >= res.last_seq and disp.state.seq >= res.last_seq, timeout=15)
        folded = ctl.state.seq
        assert (model, 0) in runtime.processes
        # Restored from the backup: the log ends before what every reader folded.
        srv.stop()
        shutil.rmtree(store / "jetstream")
        shutil.copytree(backup / "jetstream", store / "jetstream")
        srv.start()
        readers = (lambda: ctl.state, lambda: agent.state, lambda: disp.state, lambda: dash.model.live)
        # Each folds the log again; the agent, whose node the log no longer holds, joins again.
        await until(lambda: all(r().seq < folded and NODE in r().nodes for r in readers), timeout=30)
        for r in readers:
            assert model not in r().models and (model, 0) not in r().replicas
        await until(lambda: (model, 0) not in runtime.processes, timeout=15)  # the orphan is killed
        short = await admin.log.last_seq()
        # The cluster goes on from the log as it is: the model deploys and loads again.
        again = await asyncio.wait_for(admin.deploy(model, 1, size_bytes=GB), 20)
        assert again.ok and again.first_seq == short + 1, again
        await until(lambda: (r := agent.state.replicas.get((model, 0))) is not None
                    and r.state is ReplicaState.AVAILABLE, timeout=15)
        assert ctl.state.seq == await admin.log.last_seq() or ctl.state.seq >= again.last_seq
    finally:
        await admin.close()
        await bounded(dash.stop(), "dashboard.stop")
        await bounded(disp.stop(), "dispatcher.stop")
        await bounded(agent.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")
        srv.close()
