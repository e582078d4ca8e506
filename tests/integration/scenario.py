"""The operator's lifecycle scenario, shared by the scripted agent's test (tests/integration/test_controller_cli.py)
and the real agent's (tests/dataplane/test_agent.py): deploy -> scale -> scale-up -> evict one -> scale back (the WARM id returns) ->
restart -> scale-down -> evict --all --cold, through the `ndif` CLI, checking `status --json` and
`events --json` after each step, then `replay` and `history`.

`on_step(name, status)` lets a caller check reality after each step (the real agent's actors).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from controlplane.store.admin import AdminClient
from schemas.commands import CommandResult
from schemas.keys import canonical_model_key
from tests.integration.cluster import by_id, model_row, ndif, settle

Hook = Callable[[str, dict[str, Any]], Awaitable[None]]


async def _nothing(name: str, status: dict[str, Any]) -> None:
    return None


async def cli_json(url: str, *args: str) -> Any:
    ran = await ndif(url, *args, "--json")
    assert ran.rc == 0, ran.err
    return ran.json() if args[0] in ("status", "replay") else ran.lines()


async def lifecycle_scenario(url: str, admin: AdminClient, tiny: Path, *, node: str, drainer: str,
                             on_step: Hook = _nothing, settle_timeout: float = 15.0) -> dict[str, str]:
    """Run the scenario; returns the command id of each step."""
    mk = canonical_model_key(str(tiny))
    snapshots: list[dict[str, Any]] = []
    step_names: list[str] = []
    causes: dict[str, str] = {}
    size = 0

    async def step(name: str, *args: str, settle_first: bool = True) -> CommandResult:
        ran = await ndif(url, *args, "--json")
        assert ran.rc == 0, f"{name}: {ran.err}"
        res = msgspec.json.decode(ran.out.splitlines()[0], type=CommandResult)
        assert res.ok and not res.duplicate
        causes[name] = res.command_id
        step_names.append(name)
        if settle_first:
            await settle(admin, timeout=settle_timeout)
        return res

    async def check(expect: dict[int, tuple[str, str, str]], count: int) -> dict[str, Any]:
        """status --json: each replica's (level, desired, state) and the HOT count; events --json readable."""
        status = await cli_json(url, "status")
        got = {rid: (r["level"], r["desired"], r["state"]) for rid, r in by_id(status, mk).items()}
        assert got == expect, status
        assert model_row(status, mk)["replica_count"] == count
        assert status["anomaly_count"] == 0, status["anomalies"]
        for card in status["nodes"][0]["gpus"]:
            assert 0 <= card["reserved_bytes"] <= card["total_bytes"]
        events = await cli_json(url, "events", "--model", str(tiny))
        assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
        assert all(e["event"]["model_key"] == mk and "type" in e["event"] for e in events)
        snapshots.append(status)
        await on_step(step_names[-1] if step_names else "", status)
        return status

    res = await step("deploy", "deploy", str(tiny), "--replicas", "1", "--wait")
    assert [(r.replica_id, r.action) for r in res.replicas] == [(0, "scheduled")]
    st = await check({0: ("HOT", "HOT", "Available")}, 1)
    size = model_row(st, mk)["size_bytes"]
    assert size == 689152  # measured on the meta device: params + buffers of the real checkpoint
    types = [e["event"]["type"] for e in await cli_json(url, "events", "--model", str(tiny))]
    assert types == ["CommandDecided", "ModelRegistered", "DeploymentRequested", "ReplicaScheduled", "ReplicaLoading",
                     "ReplicaLoaded"]

    res = await step("scale", "scale", str(tiny), "--replicas", "2", "--wait")
    assert [r.replica_id for r in res.replicas] == [1]
    await check({0: ("HOT", "HOT", "Available"), 1: ("HOT", "HOT", "Available")}, 2)

    res = await step("scale_up", "scale", str(tiny), "--replicas", "1", "--scale-up", "--wait")
    assert [r.replica_id for r in res.replicas] == [2]
    await check({i: ("HOT", "HOT", "Available") for i in range(3)}, 3)

    res = await step("evict_one", "evict", str(tiny), "--replica-id", "2")
    assert [(r.replica_id, r.level) for r in res.evictions] == [(2, "WARM")]
    st = await check({0: ("HOT", "HOT", "Available"), 1: ("HOT", "HOT", "Available"),
                      2: ("WARM", "WARM", "Cached")}, 2)
    assert by_id(st, mk)[2]["cpu_bytes"] == size
    assert st["nodes"][0]["cpu_cached_bytes"] == size

    res = await step("scale_back", "scale", str(tiny), "--replicas", "3", "--wait")
    assert [(r.replica_id, r.action) for r in res.replicas] == [(2, "reused-warm")]  # the WARM id returns
    st = await check({i: ("HOT", "HOT", "Available") for i in range(3)}, 3)
    assert model_row(st, mk)["next_replica_id"] == 3 and st["nodes"][0]["cpu_cached_bytes"] == 0

    res = await step("restart", "restart", str(tiny), "--replica-id", "0", "--wait")
    assert [(r.replica_id, r.action) for r in res.replicas] == [(0, "restarted")]
    st = await check({i: ("HOT", "HOT", "Available") for i in range(3)}, 3)
    assert by_id(st, mk)[0]["restarts"] == 1

    res = await step("scale_down", "scale-down", str(tiny), "--replicas", "1")
    assert sorted((r.replica_id, r.level) for r in res.evictions) == [(1, "COLD"), (2, "COLD")]
    await check({0: ("HOT", "HOT", "Available"), 1: ("COLD", "COLD", "Unloaded"),
                 2: ("COLD", "COLD", "Unloaded")}, 1)
    drained = [e for e in await cli_json(url, "events", "--model", str(tiny))
               if e["event"]["type"] == "ReplicaDrained" and e["seq"] > res.last_seq]
    assert sorted(e["event"]["replica_id"] for e in drained) == [1, 2]  # drained before unloading

    await step("evict_all", "evict", "--all", "--cold")
    st = await check({i: ("COLD", "COLD", "Unloaded") for i in range(3)}, 0)
    assert all(c["reserved_bytes"] == 0 for c in st["nodes"][0]["gpus"])

    # Replay reproduces every status printed above, at the sequence it was printed at.
    # (`status` also shows each node's live heartbeat and the fact gate's refusals, which a replay
    # of the past has not: neither is in the log.)
    for snap in snapshots:
        for n in snap["nodes"]:
            assert "heartbeat_age_s" in n and "stale" in n
            del n["heartbeat_age_s"], n["stale"]
        assert snap.pop("refused_facts")["count"] == 0
        assert await cli_json(url, "replay", "--until", str(snap["seq"])) == snap
    ran = await ndif(url, "replay", "--until", str(snapshots[-1]["seq"]), "--strict")
    assert ran.rc == 0 and "REPLICAS" in ran.out

    # History explains each step of replica 2: what happened, who did it, which command caused it.
    ran = await ndif(url, "history", str(tiny), "--replica-id", "2")
    assert ran.rc == 0, ran.err
    lines = ran.out.splitlines()
    story = [(ln.split()[3], ln) for ln in lines]
    assert [t for t, _ in story] == [
        "ReplicaScheduled", "ReplicaLoading", "ReplicaLoaded",
        "ReplicaEvictionRequested", "ReplicaDrained", "ReplicaCached",
        "ReplicaScheduled", "ReplicaLoading", "ReplicaLoaded",
        "ReplicaEvictionRequested", "ReplicaDrained", "ReplicaUnloaded",
    ]
    assert f"cmd={causes['scale_up']}" in story[0][1] and "by cli:" in story[0][1]
    assert f"cmd={causes['evict_one']}" in story[3][1]
    assert f"by {drainer}" in story[4][1] and "-> UnloadRequested" in story[4][1]
    assert f"by agent:{node}" in story[5][1] and "-> Cached (WARM, desired WARM)" in story[5][1]
    assert f"cmd={causes['scale_back']}" in story[6][1] and "-> LoadRequested (WARM, desired HOT)" in story[6][1]  # weights still in the CPU cache
    assert f"cmd={causes['scale_down']}" in story[9][1] and f"by {drainer}" in story[10][1]
    assert "-> Unloaded (COLD, desired COLD)" in story[11][1]

    ran = await ndif(url, "status")
    assert ran.rc == 0 and "tiny-gpt2" in ran.out and node in ran.out
    return causes
