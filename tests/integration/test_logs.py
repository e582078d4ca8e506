"""`ndif logs MODEL [--replica-id N]`: a replica's recent lines, from the agent of its node, on a real
nats-server with the users and accounts `ndif up` generates (agents over the in-memory runtime).

- the admin reads each replica's lines: the agent's own (its facts about the replica) and the
  process's (the runtime's `recent_lines`), merged by time, bounded by `--lines`;
- a replica process that does not answer in time leaves the agent's lines, and the answer says so;
- "no such replica" is exit 3, an agent that does not answer exit 5, a bad `--lines` exit 2;
- a client cannot ask an agent for logs (its account imports no such service) and an agent
  answers only for its own node's subjects (the role matrix, role_permissions.txt, holds the rest).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
import pytest_asyncio

from controlplane.ops.auth import LocalAuth, ensure_local
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.node.agent import NodeAgent, declared_gpus
from schemas import logs as L
from schemas.errors import InvalidCommand
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState
from schemas.subjects import replica_logs_subject
from tests.fake_runtime import FakeRuntime
from tests.integration.cluster import ndif
from tests.integration.conftest import NODE_A, NODE_B
from tests.integration.probe import raw_connect
from tests.waiting import until_state

pytestmark = pytest.mark.timeout(120)
GB = 10**9


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def auth(home: Path) -> LocalAuth:
    return ensure_local([NODE_A, NODE_B], clients=["alice"], home=home)


@pytest_asyncio.fixture
async def url(auth: LocalAuth, tmp_path: Path) -> AsyncIterator[str]:
    with EmbeddedNats(tmp_path / "nats", config_file=auth.config_path) as srv:
        lg = await JetStreamEventLog.open(srv.url, creds=auth.role("admin"))
        await lg.close()
        yield srv.url


async def test_ndif_logs_reads_a_replicas_lines_from_its_agent_and_says_what_went_wrong(
        url: str, auth: LocalAuth, home: Path, tmp_path: Path) -> None:
    d = tmp_path / "models" / "tiny"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    model = canonical_model_key(str(d))
    env = {"NDIF_HOME": str(home)}
    ctl = await Controller.from_url(url, creds=auth.role("controller"), policy_interval_s=0.2).start()
    agents = [await (await NodeAgent.open(url, node, creds=auth.role(f"agent:{node}"), runtime=FakeRuntime(f"sim:{node}"),
                                          gpus=declared_gpus(1, 80 * GB), cpu_cache_bytes=10 * GB, heartbeat_s=0.3,
                                          health_interval_s=0.3, drain_timeout_s=0.0)).start()
              for node in (NODE_A, NODE_B)]
    admin = await AdminClient.open(url, timeout=10, creds=auth.role("admin"))
    try:
        res = await admin.deploy(str(d), 2, size_bytes=GB)
        assert res.ok, res
        state = await until_state(admin, lambda s: sum(r.state is ReplicaState.AVAILABLE for r in s.replicas.values()) == 2)
        nodes = {r.replica_id: r.node_id for r in state.replicas.values()}

        ran = await ndif(url, "logs", str(d), env=env)
        assert ran.rc == 0, ran.err
        for rid, node in nodes.items():
            assert f"replica {rid} on {node} (Available)" in ran.out
        assert ran.out.count("agent: ReplicaLoaded load_seconds=") == 2
        assert ran.out.count("replica: sim: loaded onto cards [0]") == 2
        block = ran.out.split("<==")[1]
        # merged by time: the process said it loaded before the agent reported it
        assert block.index("replica: sim: loaded") < block.index("agent: ReplicaLoaded"), block
        stamps = [ln.split("Z ", 1)[0] for ln in block.strip().splitlines()[:-1] if "Z " in ln]
        assert stamps == sorted(stamps) and len(stamps) >= 3, block

        ran = await ndif(url, "logs", str(d), "--replica-id", "1", "--lines", "1", "--json", env=env)
        assert ran.rc == 0, ran.err
        out = json.loads(ran.out)
        assert out["ok"] is True and [r["replica_id"] for r in out["replicas"]] == [1]
        [line] = out["replicas"][0]["lines"]
        assert "Z agent: ReplicaLoaded load_seconds=" in line, line
        assert out["replicas"][0]["truncated"] is True and "missing" not in out["replicas"][0]

        # A replica process that does not answer: the agent's lines, and it says the process's are missing.
        runtime = next(a.runtime for a in agents if a.node_id == nodes[1])
        assert isinstance(runtime, FakeRuntime)
        runtime.processes[(model, 1)].silent = True
        ran = await ndif(url, "logs", str(d), "--replica-id", "1", env=env)
        assert ran.rc == 0, ran.err
        assert "agent: ReplicaLoaded" in ran.out and "replica: sim:" not in ran.out
        assert "did not answer within 3 s" in ran.out and "note: replica 1:" in ran.err, (ran.out, ran.err)
        ran = await ndif(url, "logs", str(d), "--replica-id", "1", "--json", env=env)
        row = json.loads(ran.out)["replicas"][0]
        assert ran.rc == 0 and row["ok"] is True and "did not answer" in row["missing"], row
        runtime.processes[(model, 1)].silent = False

        ran = await ndif(url, "logs", str(d), "--replica-id", "7", env=env)
        assert ran.rc == 3 and "no such replica" in ran.err, (ran.rc, ran.err)
        ran = await ndif(url, "logs", str(d), "--lines", "0", env=env)
        assert ran.rc == 2, (ran.rc, ran.err)
        ran = await ndif(url, "logs", str(d), "--lines", str(L.MAX_LINES + 1), env=env)
        assert ran.rc == 2, (ran.rc, ran.err)

        # An agent asked for a replica it does not hold says so (it answers only for its own node).
        other = next(n for n in (NODE_A, NODE_B) if n != nodes[0])
        msg = await admin.log.nc.request(replica_logs_subject(nodes[0], model, 5), L.encode_ask(3), timeout=5)
        assert L.decode_reply(msg.data).error == "NotFound"
        with pytest.raises(nats.errors.NoRespondersError):
            await admin.log.nc.request(replica_logs_subject("node-z", model, 0), b"", timeout=5)
        del other

        # A client may not ask: its account has no route to any agent's logs.
        nc = await raw_connect(url, **auth.role("client:alice").connect_options())
        try:
            with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
                await nc.request(replica_logs_subject(nodes[0], model, 0), b"", timeout=2)
        finally:
            await nc.close()

        # The agent of replica 0's node goes away: "no agent answered", exit 5; the other still answers.
        gone = next(a for a in agents if a.node_id == nodes[0])
        await gone.halt()
        agents.remove(gone)
        ran = await ndif(url, "logs", str(d), "--json", env=env)
        assert ran.rc == 5, (ran.rc, ran.err)
        out = json.loads(ran.out)
        assert out["ok"] is False
        rows = {r["replica_id"]: r for r in out["replicas"]}
        assert rows[0]["ok"] is False and "no agent answered for node" in rows[0]["message"]
        assert rows[1]["ok"] is True and rows[1]["lines"]
    finally:
        await admin.close()
        for a in agents:
            await a.stop()
        await ctl.stop()


def test_an_answer_is_bounded_in_lines_and_bytes() -> None:
    big = L.LogsReply(ok=True, lines=["x" * 5000] * 3000)
    body = L.encode_reply(big)
    assert len(body) <= L.MAX_REPLY_BYTES
    got = L.decode_reply(body)
    assert got.truncated and 0 < len(got.lines) <= L.MAX_LINES
    assert all(len(x) <= L.MAX_LINE_CHARS for x in got.lines)
    with pytest.raises(InvalidCommand, match="lines"):
        L.decode_ask(b'{"lines": 100000}')
    with pytest.raises(InvalidCommand):
        L.decode_ask(b'{"lines": 1, "evil": 2}')
