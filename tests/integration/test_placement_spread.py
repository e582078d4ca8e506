"""Placement end to end: real nats-server, a controller, four scripted node agents, the `ndif` CLI.

Four replicas deployed on an idle 4-node cluster land on four nodes (read from `ndif status --json`);
a relative checkpoint path is made absolute where it was typed (the CLI's directory) and refused
when it reaches the controller as is; the headroom and `--gpus` are charged and shown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from controlplane.core.placement import padded
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas.commands import CommandResult
from schemas.keys import canonical_model_key
from schemas.units import GiB
from tests.agent_sim import GB, ScriptedAgent
from tests.checkpoints import TinyModels
from tests.conftest import fresh_event_log
from tests.integration.cluster import Ran, by_id, model_row, ndif, settle

pytestmark = pytest.mark.timeout(240)


@pytest_asyncio.fixture
async def log(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamEventLog]:
    lg = await fresh_event_log(nats_server.url)
    yield lg
    await lg.close()


async def ndif_in(cwd: Path, url: str, *args: str) -> Ran:
    """`ndif ARGS` run from `cwd` (relative paths mean that directory)."""
    return await ndif(url, *args, cwd=cwd)


async def test_four_replicas_spread_over_four_nodes(tiny_models: TinyModels, nats_server: EmbeddedNats, log: JetStreamEventLog,
                                                     tmp_path: Path) -> None:
    url = nats_server.url
    tiny = tiny_models.gpt2(tmp_path / "ckpt" / "tiny")
    model_dir = tmp_path / "work" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_bytes((tiny / "config.json").read_bytes())
    mk = canonical_model_key(str(model_dir))
    ctl = Controller.from_url(url, headroom=0.3)
    agents = [ScriptedAgent(url, f"node-{i}", gpus=2, cpu_cache_bytes=100 * GB) for i in range(4)]
    for p in (ctl, *agents):
        await p.start()
    try:
        async with await AdminClient.open(url, timeout=20) as admin:
            # A relative path that reaches the controller as is: refused, nothing appended.
            before = await log.last_seq()
            reply = await log.nc.request("ndif.cmd.deploy", msgspec.json.encode(
                {"verb": "deploy", "command_id": "rel-1", "model_key": "./m", "replicas": 1}), timeout=10)
            res = msgspec.json.decode(reply.data, type=CommandResult)
            assert not res.ok and res.error == "InvalidCommand" and "relative" in res.message
            assert await log.last_seq() == before

            # `ndif deploy ./m` from the directory holding m: the key is that directory's m.
            ran = await ndif_in(tmp_path / "work", url, "deploy", "./m", "--replicas", "4", "--size-gib",
                                "10", "--headroom", "0.25", "--wait")
            assert ran.rc == 0, ran.err
            await settle(admin)
            ran = await ndif(url, "status", "--json")
            assert ran.rc == 0, ran.err
            status = ran.json()
            row = model_row(status, mk)
            assert row["checkpoint"] == str(model_dir)
            assert row["headroom"] == 0.25 and row["charge_bytes"] == padded(10 * GiB, 0.25)
            reps = by_id(status, mk)
            assert len(reps) == 4 and all(r["state"] == "Available" for r in reps.values())
            assert sorted(r["node_id"] for r in reps.values()) == [f"node-{i}" for i in range(4)]
            assert all(r["bytes_per_gpu"] == padded(10 * GiB, 0.25) for r in reps.values())

            # Four more: every node takes a second replica, on its other card.
            ran = await ndif(url, "scale", str(model_dir), "--replicas", "8", "--wait")
            assert ran.rc == 0, ran.err
            status = (await ndif(url, "status", "--json")).json()
            reps = by_id(status, mk)
            cards = sorted((r["node_id"], tuple(r["gpu_indices"])) for r in reps.values())
            assert cards == sorted((f"node-{i}", (g,)) for i in range(4) for g in (0, 1))

            # --gpus 3 on nodes of 2 cards: refused, nothing appended.
            before = await log.last_seq()
            ran = await ndif(url, "scale", str(model_dir), "--replicas", "1", "--scale-up", "--gpus", "3")
            assert ran.rc == 2 and "--gpus 3" in ran.err, ran.err
            assert await log.last_seq() == before
            # --gpus 2 on another model: each replica on two cards of one node, an even share each.
            other = canonical_model_key(str(tiny))
            ran = await ndif(url, "deploy", str(tiny), "--gpus", "2", "--size-gib", "20", "--wait")
            assert ran.rc == 0, ran.err
            status = (await ndif(url, "status", "--json")).json()
            (rep,) = by_id(status, other).values()
            assert len(rep["gpu_indices"]) == 2 and rep["bytes_per_gpu"] == -(-padded(20 * GiB, 0.3) // 2)
            assert model_row(status, other)["gpus"] == 2 and model_row(status, other)["headroom"] == 0.3
            text = await ndif(url, "status")
            assert "charge" in text.out and "headroom" in text.out and "25%" in text.out
            assert status["anomaly_count"] == 0, status["anomalies"]
    finally:
        for p in (*agents, ctl):
            await p.stop()
