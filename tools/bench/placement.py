"""Benchmark of placement and the command path (controller, placement, admin client, CLI).

One run measures:
 (a) decision time (`decide`: placement included) on a cluster of 1,000 nodes x 8 x 80 GB cards
     holding 5,000 placed replicas, for scale-up and deploy commands (p50/p99);
 (b) command round trip, one at a time: admin client -> controller (its own process) -> decided and
     appended with OCC -> reply (p50/p99), against raw nats-py floors measured in the same run: a
     request/reply to a trivial responder plus a guarded 2-message atomic batch (what a 2-event
     decision's append is; JetStream fsyncs every atomic commit on a file stream);
 (c) commands/s with 16 concurrent admin clients (each its own connection).
The last line printed is one JSON object with the figures.

    python tools/bench/placement.py [--samples 1000] [--commands 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchkit import Envelope, append_in_order, pct

from controlplane.core.context import DecisionContext
from controlplane.core.decide import Registration, decide
from controlplane.core.projections import ClusterState
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.clock import observed
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas import events as E
from schemas.commands import Deploy, Scale
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState

GB = 10**9
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SIZES_GB = [7, 14, 30, 30, 65, 65, 65, 140]  # 140 GB spans two 80 GB cards


def key(i: int) -> str:
    return canonical_model_key(f"bench-org/model-{i}")


# ---- (a) placement on a large synthetic cluster ----------------------------------------------------


def big_cluster(nodes: int, replicas: int, rng: random.Random,
                events: list[E.Event] | None = None) -> tuple[ClusterState, list[str]]:
    """A cluster of `nodes` x 8 x 80 GB cards with `replicas` placed (through decide, then loaded).
    The events that built it are appended to `events` when given."""
    state = ClusterState()
    n = 0

    def put(ev: E.Event) -> None:
        state.apply(state.seq + 1, ev)
        if events is not None:
            events.append(ev)

    def env(actor: str) -> Envelope:
        nonlocal n
        n += 1
        return {"event_id": f"setup-{n}", "ts": T0, "actor": actor}

    for i in range(nodes):
        put(E.NodeJoined(**env("agent"), node_id=f"gpu-{i:04d}", cpu_cache_bytes=500 * GB,
                         gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB) for g in range(8))))
    models: list[str] = []
    placed = 0
    i = 0
    while placed < replicas:
        mk = key(i)
        want = min(10, replicas - placed)
        reg = Registration(checkpoint=f"/ckpt/{i}", size_bytes=rng.choice(SIZES_GB) * GB)
        cmd = Deploy(command_id=f"setup-deploy-{i}", model_key=mk, replicas=want)
        ctx = DecisionContext(now=T0, actor="bench", command_id=cmd.command_id, seed=i)
        for ev in decide(state, cmd, ctx, registration=reg):
            put(ev)
            if isinstance(ev, E.ReplicaScheduled):
                placed += 1
                put(E.ReplicaLoaded(**env("agent"), model_key=mk, replica_id=ev.replica_id, node_id=ev.node_id,
                                    load_seconds=1.0))
        models.append(mk)
        i += 1
    return state, models


def bench_placement(samples: int, rng: random.Random) -> dict[str, float]:
    t = time.perf_counter()
    state, models = big_cluster(1000, 5000, rng)
    hot = sum(1 for r in state.replicas.values() if r.state is ReplicaState.AVAILABLE)
    cards = [c for node in state.nodes for c in state.node_cards(node)]
    fill = sum(c.committed_bytes for c in cards) / sum(c.total_bytes for c in cards)
    print(f"(a) cluster: {len(state.nodes)} nodes, {len(cards)} cards, {hot} replicas HOT, "
          f"{fill:.0%} of GPU memory committed (built in {time.perf_counter() - t:.1f}s)", flush=True)
    now = T0 + timedelta(hours=1)
    times: list[float] = []
    cpu: list[float] = []  # this thread's CPU time: what the decision costs when the machine is shared
    scheduled = 0
    for s in range(samples):
        cid = f"sample-{s}"
        ctx = DecisionContext(now=now, actor="bench", command_id=cid, seed=s)
        if s % 4 == 3:  # a new model, 1-4 replicas
            reg = Registration(checkpoint="/ckpt/new", size_bytes=rng.choice(SIZES_GB) * GB)
            cmd: Deploy | Scale = Deploy(command_id=cid, model_key=key(100_000 + s), replicas=rng.randint(1, 4))
        else:  # one more replica of an existing model
            reg = None
            cmd = Scale(command_id=cid, model_key=rng.choice(models), replicas=1, scale_up=True)
        t0, c0 = time.perf_counter(), time.thread_time()
        evs = decide(state, cmd, ctx, registration=reg)
        cpu.append((time.thread_time() - c0) * 1000)
        times.append((time.perf_counter() - t0) * 1000)
        scheduled += sum(isinstance(e, E.ReplicaScheduled) for e in evs)
    p50, p99 = pct(times, 50), pct(times, 99)
    print(f"(a) decide on that cluster: p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {max(times):.2f} ms; CPU time "
          f"p50 {pct(cpu, 50):.2f} ms, p99 {pct(cpu, 99):.2f} ms ({samples} decisions, {scheduled} replicas placed; "
          f"the state is not changed between samples)", flush=True)
    out = {"placement_p50_ms": p50, "placement_p99_ms": p99, "cluster_fill": fill,
           "placement_cpu_p50_ms": pct(cpu, 50), "placement_cpu_p99_ms": pct(cpu, 99)}
    return out | bench_pressure(max(50, samples // 10), rng)


def _empty_cluster(node_prefix: str, *, cpu_cache_bytes: int) -> ClusterState:
    """1,000 nodes x 8 x 80 GB cards, nothing placed."""
    state = ClusterState()
    for i in range(1000):
        state.apply(state.seq + 1, E.NodeJoined(event_id=f"{node_prefix}-{i}", ts=T0, actor="agent",
                                                node_id=f"gpu-{i:04d}", cpu_cache_bytes=cpu_cache_bytes,
                                                gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB) for g in range(8))))
    return state


def _deploy_loaded(state: ClusterState, command_id: str, model_key: str, size_bytes: int, seed: int, *,
                   loaded_prefix: str) -> list[E.Event]:
    """Decide a 100-replica deploy and apply it, every scheduled replica loaded at once; the decision's events."""
    cmd = Deploy(command_id=command_id, model_key=model_key, replicas=100)
    ctx = DecisionContext(now=T0, actor="bench", command_id=cmd.command_id, seed=seed)
    evs = decide(state, cmd, ctx, registration=Registration(checkpoint="/c", size_bytes=size_bytes))
    for ev in evs:
        state.apply(state.seq + 1, ev)
        if isinstance(ev, E.ReplicaScheduled):
            state.apply(state.seq + 1, E.ReplicaLoaded(event_id=f"{loaded_prefix}-{state.seq}", ts=T0, actor="agent",
                                                       model_key=ev.model_key, replica_id=ev.replica_id,
                                                       node_id=ev.node_id))
    return evs


def _time_dedicated_deploys(state: ClusterState, samples: int, rng: random.Random, prefix: str, key_base: int,
                            sizes_gb: list[int]) -> tuple[list[float], list[float], int]:
    """Time `samples` one-replica dedicated deploys of new models on `state` (not changed between them):
    wall ms, this thread's CPU ms, and how many evictions they asked for."""
    now = T0 + timedelta(hours=1)
    times: list[float] = []
    cpu: list[float] = []
    evicted = 0
    for s in range(samples):
        cid = f"{prefix}-{s}"
        ctx = DecisionContext(now=now, actor="bench", command_id=cid, seed=s)
        cmd = Deploy(command_id=cid, model_key=key(key_base + s), replicas=1, dedicated=True)
        reg = Registration(checkpoint="/c", size_bytes=rng.choice(sizes_gb) * GB)
        t0, c0 = time.perf_counter(), time.thread_time()
        evs = decide(state, cmd, ctx, registration=reg)
        cpu.append((time.thread_time() - c0) * 1000)
        times.append((time.perf_counter() - t0) * 1000)
        evicted += sum(isinstance(e, E.ReplicaEvictionRequested) for e in evs)
    return times, cpu, evicted


def bench_pressure(samples: int, rng: random.Random) -> dict[str, float]:
    """The slow path: every card is nearly full, so a dedicated deploy must evict (fewest, smallest)."""
    state = _empty_cluster("p-node", cpu_cache_bytes=500 * GB)
    i = 0
    while True:  # 65 GB replicas (74.75 GB padded): one per card until nothing fits
        evs = _deploy_loaded(state, f"fill-{i}", key(200_000 + i), 65 * GB, i, loaded_prefix="l")
        i += 1
        if any(isinstance(ev, E.PlacementRejected) for ev in evs):
            break
    times, cpu, evicted = _time_dedicated_deploys(state, samples, rng, "pressure", 300_000, [7, 30, 65])
    p50, p99 = pct(times, 50), pct(times, 99)
    print(f"(a') full cluster ({len(state.replicas)} replicas, every card ~93% committed), dedicated deploys that "
          f"must evict: p50 {p50:.2f} ms, p99 {p99:.2f} ms; CPU time p50 {pct(cpu, 50):.2f} ms, p99 "
          f"{pct(cpu, 99):.2f} ms ({samples} decisions, {evicted} evictions)", flush=True)
    return {"pressure_p50_ms": p50, "pressure_p99_ms": p99, "pressure_cpu_p50_ms": pct(cpu, 50),
            "pressure_cpu_p99_ms": pct(cpu, 99)} | bench_pressure_mixed(samples, rng)


def bench_pressure_mixed(samples: int, rng: random.Random) -> dict[str, float]:
    """The exact eviction search at work: cards shared by several replicas, some spanning 2-4 cards,
    nothing free; a dedicated deploy of 1-3 cards must find the fewest, smallest victims per node."""
    state = _empty_cluster("m-node", cpu_cache_bytes=0)
    i = 0
    for size_gb in (140, 30, 14, 7):  # big multi-card replicas first, then small ones fill the gaps
        while True:
            evs = _deploy_loaded(state, f"mfill-{i}", key(400_000 + i), size_gb * GB, i, loaded_prefix="ml")
            i += 1
            if any(isinstance(ev, E.PlacementRejected) for ev in evs) or i > 400:
                break
    cards = [c for node in state.nodes for c in state.node_cards(node)]
    fill = sum(c.committed_bytes for c in cards) / sum(c.total_bytes for c in cards)
    times, cpu, evicted = _time_dedicated_deploys(state, samples, rng, "mixed", 500_000, [20, 60, 120, 180])
    p50, p99 = pct(times, 50), pct(times, 99)
    print(f"(a'') mixed full cluster ({len(state.replicas)} replicas, {fill:.0%} committed, multi-card replicas), "
          f"dedicated deploys of 1-3 cards that must evict: p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {max(times):.2f} ms; "
          f"CPU time p50 {pct(cpu, 50):.2f} ms, p99 {pct(cpu, 99):.2f} ms ({samples} decisions, {evicted} evictions)",
          flush=True)
    return {"pressure_mixed_p50_ms": p50, "pressure_mixed_p99_ms": p99, "pressure_mixed_fill": fill,
            "pressure_mixed_cpu_p50_ms": pct(cpu, 50), "pressure_mixed_cpu_p99_ms": pct(cpu, 99)}


# ---- (b), (c) the command path -----------------------------------------------------------------------


async def raw_baselines(url: str, n: int) -> dict[str, float]:
    """Raw nats-py floors of a command's two hops: a request/reply to a trivial responder, and the
    append a 2-event decision is (a guarded atomic batch of 2 messages; R1 file streams fsync each
    atomic commit) on a stream of the same settings."""
    import uuid

    import nats
    from nats.js import api

    nc = await nats.connect(url)
    responder = await nats.connect(url)

    async def echo(msg: object) -> None:
        await msg.respond(b"{}")  # type: ignore[attr-defined]

    await responder.subscribe("bench.echo", cb=echo)
    await responder.flush()  # the subscription is on the server before the first request
    body = json.dumps({"type": "DeploymentRequested", "pad": "x" * 300}).encode()
    rr: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        await nc.request("bench.echo", body, timeout=5)
        rr.append((time.perf_counter() - t0) * 1000)
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="RAW", subjects=["raw.>"], storage=api.StorageType.FILE,
                                         allow_atomic=True, deny_delete=True, deny_purge=True))
    last, batch = 0, []
    for _ in range(n):
        b = uuid.uuid4().hex
        t0 = time.perf_counter()
        await nc.publish("raw.a", body, headers={"Nats-Batch-Id": b, "Nats-Batch-Sequence": "1",
                                                 "Nats-Expected-Last-Sequence": str(last)})
        await nc.request("raw.a", body, headers={"Nats-Batch-Id": b, "Nats-Batch-Sequence": "2",
                                                 "Nats-Batch-Commit": "1"}, timeout=5)
        batch.append((time.perf_counter() - t0) * 1000)
        last += 2
    await responder.close()
    await nc.close()
    return {"raw_request_reply_p50_ms": pct(rr, 50), "raw_batch2_append_p50_ms": pct(batch, 50)}


async def bench_commands(url: str, commands: int, ckpt: str) -> dict[str, float]:
    log = await JetStreamEventLog.open(url)
    for i in range(32):  # a cluster the commands can place on
        await log.append([observed(E.NodeJoined, actor="bench", node_id=f"node-{i}", cpu_cache_bytes=0,
                                   gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB) for g in range(8)))], None)
    await log.close()
    env = {**os.environ, "NDIF_LOG_LEVEL": "WARNING"}
    ctl = subprocess.Popen([sys.executable, "-m", "dataplane.ops.cli", "controller", "--nats", url,
                            "--heartbeat-grace", "3600"], env=env)  # the bench has no agents
    try:
        async with await AdminClient.open(url, timeout=30) as admin:
            # The controller is up once it answers; the first deploys also register the models.
            for _ in range(100):
                try:
                    await admin.deploy(ckpt + "/m0", 1, size_bytes=5 * GB)
                    break
                except Exception:  # noqa: BLE001 - not subscribed yet
                    await asyncio.sleep(0.1)
            for j in range(1, 16):
                await admin.deploy(f"{ckpt}/m{j}", 1, size_bytes=5 * GB)
            rtt: list[float] = []
            for i in range(commands):
                m = f"{ckpt}/m{i % 16}"
                t0 = time.perf_counter()
                if i % 2 == 0:
                    await admin.scale(m, 1, scale_up=True)  # 2 events: requested + scheduled
                else:
                    await admin.scale_down(m, 1)  # 2 events: requested + eviction
                rtt.append((time.perf_counter() - t0) * 1000)
        p50, p99 = pct(rtt, 50), pct(rtt, 99)
        print(f"(b) command round trip, one at a time: p50 {p50:.2f} ms, p99 {p99:.2f} ms ({commands} commands)",
              flush=True)
        clients = [await AdminClient.open(url, timeout=60) for _ in range(16)]
        per = max(1, commands // 16)

        async def worker(c: AdminClient, w: int) -> None:
            for i in range(per):
                m = f"{ckpt}/m{w}"
                if i % 2 == 0:
                    await c.scale(m, 1, scale_up=True)
                else:
                    await c.scale_down(m, 1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c, w) for w, c in enumerate(clients)))
        el = time.perf_counter() - t0
        for c in clients:
            await c.close()
        cps = 16 * per / el
        print(f"(c) 16 concurrent clients: {16 * per} commands in {el:.2f}s = {cps:.0f} commands/s", flush=True)
        big = await bench_big_rtt(url, max(100, commands // 4))
        return {"command_rtt_p50_ms": p50, "command_rtt_p99_ms": p99, "commands_per_s_16": cps} | big
    finally:
        ctl.terminate()
        ctl.wait(10)


async def bench_big_rtt(url: str, commands: int) -> dict[str, float]:
    """(d) The round trip again once the controller folds the 1,000-node, 5,000-replica cluster."""
    events: list[E.Event] = []
    _, models = big_cluster(1000, 5000, random.Random(5), events)
    log = await JetStreamEventLog.open(url)
    t0 = time.perf_counter()
    await append_in_order(log, events)  # the agents' facts one by one, as agents append them
    print(f"(d) {len(events):,} events of the big cluster appended in {time.perf_counter() - t0:.1f} s", flush=True)
    await log.close()
    rtt: list[float] = []
    async with await AdminClient.open(url, timeout=60) as admin:
        await admin.scale(models[0], 1, scale_up=True)  # the controller has folded the cluster
        for i in range(commands):
            m = models[(i // 2) % len(models)]
            t0 = time.perf_counter()
            if i % 2 == 0:
                await admin.scale(m, 1, scale_up=True)
            else:
                await admin.scale_down(m, 10)
            rtt.append((time.perf_counter() - t0) * 1000)
    p50, p99 = pct(rtt, 50), pct(rtt, 99)
    print(f"(d) command round trip with the controller holding 1,000 nodes / 5,000 replicas ({len(events):,} events "
          f"folded): p50 {p50:.2f} ms, p99 {p99:.2f} ms ({commands} commands)", flush=True)
    return {"command_rtt_big_p50_ms": p50, "command_rtt_big_p99_ms": p99}


async def amain(a: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(a.seed)
    out = bench_placement(a.samples, rng)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        for m in range(16):
            (ckpt / f"m{m}").mkdir(parents=True)
            (ckpt / f"m{m}" / "config.json").write_text('{"model_type": "gpt2"}')
        srv = EmbeddedNats(Path(tmp) / "nats")
        srv.start()
        try:
            lg = await JetStreamEventLog.open(srv.url)
            await lg.close()
            out |= await bench_commands(srv.url, a.commands, str(ckpt))
            base = await raw_baselines(srv.url, 500)
            out |= base
            floor = base["raw_request_reply_p50_ms"] + base["raw_batch2_append_p50_ms"]
            out["command_rtt_over_raw_floor"] = out["command_rtt_p50_ms"] / floor
            print(f"baselines (raw nats-py, same server): request/reply p50 {base['raw_request_reply_p50_ms']:.2f} ms,"
                  f" guarded 2-message atomic batch p50 {base['raw_batch2_append_p50_ms']:.2f} ms; the command round"
                  f" trip p50 is {out['command_rtt_over_raw_floor']:.2f}x their sum ({floor:.2f} ms)", flush=True)
        finally:
            srv.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1000, help="placement decisions to time")
    p.add_argument("--commands", type=int, default=1000, help="commands for the round trip and throughput runs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--placement-only", action="store_true", help="(a) only: no NATS, no command path")
    a = p.parse_args()
    if a.placement_only:
        out = bench_placement(a.samples, random.Random(a.seed))
        print(json.dumps({k: round(v, 3) for k, v in out.items()}))
        return
    out = asyncio.run(amain(a))
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
