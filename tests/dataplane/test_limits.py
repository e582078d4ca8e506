"""What the serving path refuses, waits for and prints, on a real service: real nats-server, real local Ray (2 CPUs, 2 declared GPUs),
real controller, agent, dispatcher and tiny models; CLI and SDK as users run them (subprocesses).

- a model no node can ever hold ends its requests at once with the reason; one with no room now
  waits without appending on every retry, and is served once room is made; the queue has a lifetime;
- replica actors ask Ray for CPU, so Ray refuses what the node cannot run;
- a node id held by a live agent refuses a second agent; a stopped one is taken over;
- the README snippet runs as written; `Client()` finds the server from NDIF_NATS_URL; the SDK
  prints nothing of its own; `ndif submit` prints JSON results as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import DEFAULT_URL, Client, RequestFailed
from dataplane.node.agent import NodeAgent, NodeIdHeld, declared_gpus
from schemas.keys import canonical_model_key
from tests.dataplane.conftest import running_service
from tests.integration.cluster import ndif

pytestmark = pytest.mark.timeout(300)
GB = 10**9
ROOT = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture
async def service(nats_server: EmbeddedNats, local_ray: str) -> AsyncIterator[dict[str, Any]]:
    async with running_service(nats_server.url, local_ray, drain_timeout_s=5) as parts:
        yield parts


async def _events(lg: JetStreamEventLog, model: Path) -> list[str]:
    mk = canonical_model_key(str(model))
    return [type(e).__name__ async for _, e in lg.read() if getattr(e, "model_key", None) == mk]


async def _fill_both_cards(admin: AdminClient, models: dict[str, Path]) -> None:
    """Two gpt2 replicas that claim 60 GB each (69 GB with headroom): one per 80 GB card, just loaded
    (so pressure may not evict them). A 60 GB model fits an empty node but has no room now."""
    res = await admin.deploy(str(models["gpt2"]), 2, size_bytes=60 * GB)
    assert len(res.replicas) == 2
    await admin.wait(res, timeout=120)
    res = await admin.deploy(str(models["llama"]), 1, size_bytes=60 * GB)  # registers its size; no room
    assert res.rejections and not res.replicas


async def test_a_model_no_node_can_hold_ends_at_once_with_the_reason(service: dict[str, Any],
                                                                     models: dict[str, Path]) -> None:
    admin, lg = service["admin"], service["log"]
    res = await admin.deploy(str(models["llama"]), 1, size_bytes=10_000 * GB)  # 11,500 GB with headroom
    assert res.rejections
    before = await _events(lg, models["llama"])
    async with Client(service["url"]) as c:
        job = await c.submit(str(models["llama"]), {"op": "forward", "input_ids": [[1]]})
        with pytest.raises(RequestFailed) as exc:
            await job.result(timeout=20)  # at once, not after a lifetime in the queue
        assert exc.value.error == "PlacementImpossible"
        assert "largest card is 74.51 GiB" in str(exc.value) and "needs 10,710.21 GiB" in str(exc.value), exc.value
        after_first = await _events(lg, models["llama"])
        # More requests for it end the same way without asking the controller again.
        jobs = [await c.submit(str(models["llama"]), {"op": "forward", "input_ids": [[i + 1]]}) for i in range(5)]
        for j in jobs:
            with pytest.raises(RequestFailed, match=r"largest card is 74\.51 GiB"):
                await j.result(timeout=20)
    assert after_first[len(before):] == ["CommandDecided", "DeploymentRequested", "PlacementRejected"]
    assert await _events(lg, models["llama"]) == after_first


async def test_no_room_now_waits_quietly_and_is_served_once_room_is_made(service: dict[str, Any],
                                                                        models: dict[str, Path]) -> None:
    admin, lg = service["admin"], service["log"]
    provisioner = service["dispatcher"].provisioner
    provisioner.retry_s = 0.2  # looks at the waiting model every 0.2 s (5 s in service)
    await _fill_both_cards(admin, models)
    deploys: list[bytes] = []

    async def on_deploy(msg: Any) -> None:
        deploys.append(msg.data)

    sub = await lg.nc.subscribe("ndif.cmd.deploy", cb=on_deploy)
    async with Client(service["url"]) as c:
        jobs = [await c.submit(str(models["llama"]), {"op": "forward", "input_ids": [[i + 1]]}) for i in range(3)]
        async with asyncio.timeout(30):
            while "no room" not in (((s := await jobs[0].latest()) and s.message) or ""):
                await asyncio.sleep(0.1)
        told, asked = await _events(lg, models["llama"]), len(deploys)
        # Five more looks at the unchanged cluster (the old code deployed again at each backoff,
        # two events each time): no deploy is sent, nothing is appended.
        looked = provisioner.rechecks
        async with asyncio.timeout(30):
            while provisioner.rechecks < looked + 5:
                await asyncio.sleep(0.05)
        assert asked >= 1 and len(deploys) == asked
        assert await _events(lg, models["llama"]) == told
        latest = [await j.latest() for j in jobs]
        assert all(s is not None and not s.terminal for s in latest), latest
        await admin.scale_down(str(models["gpt2"]), 1)  # room on card 1: the waiting model is placed
        done = await asyncio.gather(*(j.result(timeout=120) for j in jobs))
    await sub.unsubscribe()
    assert all(d["next_token_ids"] for d in done)
    tail = (await _events(lg, models["llama"]))[len(told):]
    assert tail.count("DeploymentRequested") == 1 and "PlacementRejected" not in tail, tail


async def test_a_request_waits_in_the_queue_at_most_its_lifetime(service: dict[str, Any],
                                                                 models: dict[str, Path]) -> None:
    await _fill_both_cards(service["admin"], models)
    service["dispatcher"].intake.queue_lifetime_s = 3.0  # the part that expires queued requests
    async with Client(service["url"]) as c:
        job = await c.submit(str(models["llama"]), {"op": "forward", "input_ids": [[1]]})
        with pytest.raises(RequestFailed) as exc:
            await job.result(timeout=30)
    assert exc.value.error == "QueueTimeout" and "NDIF_REQUEST_QUEUE_LIFETIME_S" in str(exc.value), exc.value


async def test_replica_actors_ask_ray_for_cpu_so_ray_refuses_what_the_node_cannot_run(
        service: dict[str, Any], models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NDIF_REPLICA_CPUS", "1.5")  # the test's Ray has 2 CPUs: one such replica fits
    admin = service["admin"]
    res = await admin.deploy(str(models["gpt2"]), 1)  # the one that fits (default 60 s to start: slow CI)
    await admin.wait(res, timeout=120)
    service["agent"].schedule_timeout_s = 3.0  # Ray can never start it: how long the agent waits to say so
    res = await admin.scale(str(models["gpt2"]), 2)  # a second one Ray has no CPU for
    state = await admin.wait(res, timeout=120)
    mk = canonical_model_key(str(models["gpt2"]))
    states = sorted(str(state.replicas[(mk, i)].state) for i in (0, 1))
    assert states == ["Available", "LoadFailed"], states
    failed = next(r for r in state.replicas.values() if str(r.state) == "LoadFailed")
    assert "Ray did not start the replica's actor" in (failed.error or "") and "1.5 CPU" in (failed.error or "")


async def test_a_node_id_held_by_a_live_agent_refuses_a_second_agent(service: dict[str, Any]) -> None:
    url = service["url"]
    env = {**os.environ, "RAY_ADDRESS": service["gcs"], "NDIF_LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", "agent", "--nats", url, "--node-id", "node-a", "--gpus", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # it wrongly started: stop it (it would act as a second node-a)
            proc.kill()
            await proc.wait()
    lines = [ln for ln in err.decode().splitlines() if ln.startswith("error:")]
    assert proc.returncode == 5, (out, err)
    assert lines and "node id 'node-a' is held by a live agent" in lines[0] and "--node-id" in lines[0], err
    state = await service["admin"].state()
    assert [n.node_id for n in state.nodes.values()] == ["node-a"]
    assert len(state.nodes["node-a"].gpus) == 2  # the live agent's NodeJoined still stands

    # A node id whose agent stopped (its goodbye heartbeat) is taken over at once.
    z = await (await NodeAgent.open(url, "node-z", gpus=declared_gpus(1, GB), heartbeat_s=0.2)).start()
    await z.stop()
    t0 = asyncio.get_running_loop().time()
    z2 = await (await NodeAgent.open(url, "node-z", gpus=declared_gpus(1, GB), heartbeat_s=0.2)).start()
    assert asyncio.get_running_loop().time() - t0 < 5
    # ... and one still beating is refused in-process too.
    with pytest.raises(NodeIdHeld):
        await (await NodeAgent.open(url, "node-z", gpus=declared_gpus(1, GB), heartbeat_s=0.2)).start()
    await z2.stop()


def test_client_defaults_to_ndif_nats_url_then_the_local_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NDIF_NATS_URL", raising=False)
    assert Client().url == DEFAULT_URL == "nats://127.0.0.1:4222"
    monkeypatch.setenv("NDIF_NATS_URL", "nats://10.0.0.1:4333")
    assert Client().url == "nats://10.0.0.1:4333"
    assert Client("nats://h:1").url == "nats://h:1"


def _readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    snippet = next(b for b in blocks if "Client(" in b)
    assert "asyncio.run(" in snippet
    return snippet


async def test_the_readme_snippet_runs_as_written_and_prints_only_its_own_output(
        service: dict[str, Any], models: dict[str, Path], tmp_path: Path) -> None:
    snippet = _readme_snippet()
    where = 'os.path.join(HOME, "models", "tiny-gpt2")'
    assert where in snippet  # the only change: where this test keeps the checkpoint
    script = tmp_path / "hello.py"
    script.write_text(snippet.replace(where, repr(str(models["gpt2"]))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_LOG")}
    env["NDIF_NATS_URL"] = service["url"]  # Client() with no URL finds the server here
    env["PYTHONPATH"] = str(ROOT)  # the tree under test (a script's own directory comes first otherwise)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), cwd=tmp_path, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    statuses = lines[:-1]
    assert statuses and all(re.fullmatch(r"[A-Z]+ (None|\d+)", ln) for ln in statuses), lines
    assert statuses[-1].startswith("COMPLETED")
    assert lines[-1].startswith("{") and "text" in lines[-1]
    assert err.decode().strip() == ""


async def test_the_sdk_never_writes_to_stdout_even_when_it_logs(tmp_path: Path) -> None:
    """structlog's own default writes to stdout; importing the SDK routes it to silent stdlib logging."""
    script = tmp_path / "quiet.py"
    script.write_text(
        "import structlog\n"
        "from dataplane.client import Client\n"
        "structlog.get_logger('ndif.client').warning('something_happened', request_id='r1')\n"
        "structlog.get_logger('ndif.eventstore').error('worse', seq=3)\n"
        "print('mine')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NDIF_LOG")}
    env["PYTHONPATH"] = str(ROOT)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), cwd=tmp_path, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    assert out.decode() == "mine\n" and err.decode() == ""


async def test_submit_prints_json_results_as_json(service: dict[str, Any], models: dict[str, Path]) -> None:
    res = await service["admin"].deploy(str(models["gpt2"]), 1)
    await service["admin"].wait(res, timeout=120)
    ran = await ndif(service["url"], "submit", str(models["gpt2"]), "--input-ids", "1,2,3", "--forward")
    assert ran.rc == 0, ran.err
    result = json.loads(ran.out.splitlines()[-1])  # was a Python repr (single quotes): not JSON
    assert result["next_token_ids"] and isinstance(result["next_token_ids"][0], int)
