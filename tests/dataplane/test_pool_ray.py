"""The replica process pool on a real local Ray: a COLD load takes the pooled process (the replica's
pid is the member's: no process started), the replica answers under its contract name (the alias),
is listed as a replica, serves, and the pool fills again with a new process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dataplane.runtime import ray_adapter
from dataplane.runtime.pool import member_prefix
from dataplane.runtime.ports import ReplicaSpec
from dataplane.runtime.ray_adapter import RayRuntime

pytestmark = pytest.mark.timeout(240)


async def until_ready(rt: RayRuntime, ready: int, timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while rt.pool_report()[0] < ready:
        assert time.monotonic() < deadline, f"pool not ready: {rt.pool_report()}"
        await asyncio.sleep(0.2)


async def test_a_cold_load_takes_the_pooled_process_and_the_pool_refills(local_ray: str, models: dict[str, Path]) -> None:
    rt = RayRuntime(pool_size=1)
    await rt.start_pool()
    try:
        await until_ready(rt, 1)
        [(member, pooled)] = rt.pool.ready.items()
        pooled_pid = await pooled.pid.remote()
        spec = ReplicaSpec(model_key="pool-test", replica_id=0, checkpoint=str(models["gpt2"]), node_id="n")
        handle = await rt.create(spec)
        assert rt.pool.report()[0] == 0, "the member left the pool"
        await rt.load(handle, [], 0)
        info = await rt.info(handle)
        assert info["pid"] == pooled_pid and info["level"] == "HOT" and info["model_key"] == "pool-test"

        found = await rt.get("pool-test", 0)  # the contract name resolves to the member (an alias)
        assert found is not None and await found.pid.remote() == pooled_pid
        assert ("pool-test", 0) in {(f.model_key, f.replica_id) for f in await rt.list()}
        answers = await ray_adapter.RayCaller().run_batch(found, [{"op": "forward", "input_ids": [[1, 2, 3]]}], ["ann"])
        assert type(answers[0]).__name__ == "Completed"

        await until_ready(rt, 1)  # refilled in the background: a new process, a new name
        [(again, refill)] = rt.pool.ready.items()
        assert again != member and await refill.pid.remote() != pooled_pid

        await rt.kill(handle)
        assert await rt.get("pool-test", 0) is None  # a dead member's alias names nothing
        assert ray_adapter.drop_stale_aliases(member_prefix(rt.location)) == 1  # and is forgotten
        assert ray_adapter.drop_stale_aliases(member_prefix(rt.location)) == 0
    finally:
        await rt.stop_pool(kill=True)
