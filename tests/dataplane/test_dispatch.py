"""Requests end to end: SDK -> NDIF_REQUESTS -> dispatcher -> processor workers -> Ray actors -> statuses.

Real nats-server, real local Ray (declared GPUs), real controller, node agent and tiny models.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import ray

from controlplane.admin import AdminClient
from controlplane.controller import Controller
from controlplane.eventstore import JetStreamEventLog
from controlplane.nats_server import EmbeddedNats
from dataplane.agent import NodeAgent, declared_gpus
from dataplane.client import Client, RequestFailed
from dataplane.dispatcher import Dispatcher
from dataplane.model import ModelReplica
from dataplane.model_actor import NAMESPACE, get_actor, list_replica_actors
from schemas.keys import canonical_model_key
from schemas.subjects import request_subject
from tests.conftest import fresh_event_log
from tools.tiny_models import make_tiny_gpt2, make_tiny_llama

pytestmark = pytest.mark.timeout(300)
GB = 10**9


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_gpus=2, num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"gpt2": make_tiny_gpt2(root / "gpt2"), "llama": make_tiny_llama(root / "llama")}


def kill_all_actors() -> None:
    for mk, rid, _ in list_replica_actors():
        h = get_actor(mk, rid)
        if h is not None:
            ray.kill(h, no_restart=True)


@pytest_asyncio.fixture
async def service(nats_server: EmbeddedNats, local_ray: None) -> AsyncIterator[dict[str, Any]]:
    """Controller + agent + dispatcher on fresh streams; yields the parts."""
    kill_all_actors()
    lg: JetStreamEventLog = await fresh_event_log(nats_server.url)
    url = nats_server.url
    ctl = await Controller(url, policy_interval_s=0.2).start()
    agent = await NodeAgent(url, "node-a", gpus=declared_gpus(2, 80 * GB), cpu_cache_bytes=10 * GB,
                            heartbeat_s=0.5, drain_timeout_s=30, health_interval_s=0.5).start()
    disp = await Dispatcher(url).start()
    admin = await AdminClient.open(url, timeout=30)
    try:
        yield {"url": url, "controller": ctl, "agent": agent, "dispatcher": disp, "admin": admin, "log": lg}
    finally:
        await admin.close()
        await disp.stop()
        await agent.stop()
        await ctl.stop()
        await lg.close()
        kill_all_actors()


def expected_next_tokens(ckpt: Path, inputs: list[list[int]]) -> list[int]:
    r = ModelReplica("ref", 0, str(ckpt))
    r.load()
    return [r({"op": "forward", "input_ids": [ids]})["next_token_ids"][0] for ids in inputs]


async def test_200_requests_over_2_replicas_with_an_eviction_mid_burst(service: dict[str, Any],
                                                                       models: dict[str, Path]) -> None:
    url, admin = service["url"], service["admin"]
    res = await admin.deploy(str(models["gpt2"]), 2)
    await admin.wait(res, timeout=120)
    inputs = [[(7 * i + j) % 997 for j in range(1 + i % 9)] for i in range(200)]
    want = expected_next_tokens(models["gpt2"], inputs)
    async with Client(url) as c:
        jobs = [await c.submit(str(models["gpt2"]), {"op": "forward", "input_ids": [ids]}) for ids in inputs]
        # Evict replica 1 while the burst is in flight (drained first: no request may be lost).
        await admin.evict(str(models["gpt2"]), replica_id=1)
        finals = await asyncio.gather(*(_final(j) for j in jobs))
        results = [await j.result() for j in jobs]
    assert [r["next_token_ids"][0] for r in results] == want  # every request, the right answer
    used = Counter(f.replica_id for f in finals)
    assert set(used) == {0, 1}, used  # both replicas served
    st = await admin.state()
    mk = canonical_model_key(str(models["gpt2"]))
    assert str(st.replicas[(mk, 1)].state) in ("Cached", "UnloadRequested", "Draining")
    drained = [e async for _, e in admin.events(model=str(models["gpt2"])) if type(e).__name__ == "ReplicaDrained"]
    assert drained and drained[0].actor.startswith("dispatcher:")  # the dispatcher reported the drain
    assert st.anomaly_count == 0, st.anomalies


async def _final(job: Any) -> Any:
    last = None
    async for s in job.statuses(timeout=120):
        last = s
    return last


async def test_first_request_provisions_and_statuses_stream(service: dict[str, Any], models: dict[str, Path]) -> None:
    url, admin = service["url"], service["admin"]
    async with Client(url) as c:
        job = await c.submit(str(models["llama"]), {"op": "generate", "input_ids": [[1, 2, 3]], "max_new_tokens": 4})
        seen = [s async for s in job.statuses(timeout=120)]
    kinds = [str(s.status) for s in seen]
    assert kinds[-1] == "COMPLETED", kinds
    assert "QUEUED" in kinds and "RUNNING" in kinds
    assert "PROVISIONING" in kinds or "DEPLOYING" in kinds  # the user was told the model was coming up
    assert len(seen[-1].result["output_ids"][0]) == 7
    st = await admin.state()
    assert st.replica_count(canonical_model_key(str(models["llama"]))) == 1  # NDIF_MODEL_REPLICAS_DEFAULT


async def test_bad_requests_get_error_and_disturb_nothing(service: dict[str, Any], models: dict[str, Path],
                                                          tmp_path: Path) -> None:
    url, admin, lg = service["url"], service["admin"], service["log"]
    res = await admin.deploy(str(models["gpt2"]), 1)
    await admin.wait(res, timeout=120)
    async with Client(url) as c:
        bad_op = await c.submit(str(models["gpt2"]), {"op": "train"})
        with pytest.raises(RequestFailed, match="unknown op") as info:
            await bad_op.result(timeout=60)
        assert info.value.error == "BadRequest"
        (tmp_path / "nothing").mkdir()
        unknown = await c.submit(str(tmp_path / "nothing"), {"op": "forward", "input_ids": [[1]]})
        with pytest.raises(RequestFailed, match="unknown model"):
            await unknown.result(timeout=60)
        # Malformed JSON straight onto a model's request subject: an ERROR for its id, nothing else moves.
        mk = canonical_model_key(str(models["gpt2"]))
        await lg.js.publish(request_subject(mk), b'{"request_id": "bad-json-1", "model_key": ',
                            headers={"Nats-Msg-Id": "bad-json-1"})
        broken = await c.job("bad-json-1")
        final = await _final_kept(broken)
        assert str(final.status) == "ERROR" and "malformed" in final.message
        with pytest.raises(Exception, match="byte limit"):
            await c.submit(str(models["gpt2"]), {"op": "forward", "input_ids": [[1]], "pad": "x" * (1 << 20)})
        ok = await c.run(str(models["gpt2"]), {"op": "forward", "input_ids": [[1, 2]]}, timeout=60)
        assert ok["next_token_ids"]  # the replica kept serving
    st = await admin.state()
    assert st.anomaly_count == 0


async def _final_kept(job: Any) -> Any:
    async with asyncio.timeout(60):
        while True:
            kept = await job.latest()
            if kept is not None and kept.terminal:
                return kept
            await asyncio.sleep(0.1)
