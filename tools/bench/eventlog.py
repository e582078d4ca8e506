"""Benchmark of the event log: appends, reads and projection rebuilds.

Starts its own nats-server (file storage, temp dir) and measures, in one run:
 (a) one writer appending decisions of 1-5 events with OCC: latency per decision;
 (b) 16 concurrent commands through the group committer vs the baseline of awaited guarded single
     publishes (`Nats-Expected-Last-Sequence`) of the same events;
 (c) a projection rebuild (read + decode + fold) of >= 200,000 events vs a raw nats-py ordered
     consumer draining the same stream.
(a) and (b) run on a server of each `--sync` setting (figures under `2m` get keys ending in `_nosync`;
`decision_over_raw` is (a)'s p50 over its raw floor); (c) reads, so it runs once, on the first. Before
them, `fsync_p50_ms` / `fsync_p99_ms`: a small append and `os.fsync` on the stores' filesystem.
The last line printed is one JSON object with the figures.

    python tools/bench/eventlog.py [--events 200000] [--decisions 2000] [--sync always|2m|both]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats
from benchkit import SYNC_CHOICES, Envelope, ReplicaRef, add_sync_option, bulk_append, fsync_ms, pct, sync_suffix
from nats.aio.msg import Msg
from nats.js import api

from controlplane.core.context import DecisionContext
from controlplane.core.projections import ClusterState
from controlplane.core.projections.base import afold_batches
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.committer import GroupCommitter
from controlplane.store.eventstore import JetStreamEventLog
from schemas import events as E
from schemas.status import DeploymentOp, EvictionReason, Level
from schemas.subjects import EVENTS_ALL, EVENTS_STREAM

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GB = 2**30
NODES = [f"gpu-{i:04d}.bench" for i in range(64)]
MODELS = [f'nnsight.modeling.language.LanguageModel:{{"repo_id": "org/model-{i}", "revision": null}}'
          for i in range(50)]


class Ids:
    def __init__(self, prefix: str) -> None:
        self.prefix, self.n, self.rid = prefix, 0, 0

    def env(self, actor: str = "bench") -> Envelope:
        self.n += 1
        return {"event_id": f"{self.prefix}-{self.n}", "ts": T0 + timedelta(microseconds=self.n), "actor": actor}


def decision(ids: Ids, k: int, rnd: random.Random) -> list[E.Event]:
    """A controller-like decision of k events: a deployment request and k-1 schedules (new ids)."""
    m = rnd.choice(MODELS)
    out: list[E.Event] = [E.DeploymentRequested(**ids.env(), model_key=m, op=DeploymentOp.SCALE, replicas=k,
                                                target_hot=k)]
    for _ in range(k - 1):
        ids.rid += 1
        out.append(E.ReplicaScheduled(**ids.env(), model_key=m, replica_id=ids.rid, node_id=rnd.choice(NODES),
                                      gpu_indices=(ids.rid % 8,), bytes_per_gpu=GB // 16))
    return out


def joins(ids: Ids) -> list[E.Event]:
    return [E.NodeJoined(**ids.env("agent"), node_id=nd, cpu_cache_bytes=512 * GB,
                         gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB) for g in range(8))) for nd in NODES]


def lifecycle_events(n: int) -> list[E.Event]:
    """n events of realistic replica lifecycles on 64 nodes x 8 cards (for the rebuild)."""
    ids = Ids("rb")
    out: list[E.Event] = joins(ids)
    rid = 0
    while len(out) < n:
        m = MODELS[rid % len(MODELS)]
        nd = NODES[rid % len(NODES)]
        g = (rid // len(NODES)) % 8
        rep: ReplicaRef = {"model_key": m, "replica_id": rid, "node_id": nd}
        for _ in range(3):  # COLD -> HOT -> WARM -> HOT ... -> COLD
            out += [
                E.ReplicaScheduled(**ids.env("controller"), **rep, gpu_indices=(g,), bytes_per_gpu=GB // 8),
                E.ReplicaLoading(**ids.env("agent"), **rep),
                E.ReplicaLoaded(**ids.env("agent"), **rep, load_seconds=1.0),
                E.ReplicaEvictionRequested(**ids.env("controller"), **rep, reason=EvictionReason.PRESSURE,
                                           target=Level.WARM),
                E.ReplicaCached(**ids.env("agent"), **rep, cpu_bytes=GB // 8),
            ]
        out += [E.ReplicaEvictionRequested(**ids.env("controller"), **rep, reason=EvictionReason.ADMIN,
                                           target=Level.COLD),
                E.ReplicaUnloaded(**ids.env("agent"), **rep)]
        rid += 1
    return out[:n]


async def bench_single_writer(log: JetStreamEventLog, decisions: int) -> dict[str, float]:
    rnd = random.Random(1)
    ids = Ids("sw")
    last = await bulk_append(log, joins(ids))  # the agents' joins: the setup, not a decision
    lat, total, t0 = [], 0, time.perf_counter()
    for _ in range(decisions):
        evs = decision(ids, rnd.randint(1, 5), rnd)
        s = time.perf_counter()
        res = await log.append(evs, last)
        lat.append((time.perf_counter() - s) * 1000)
        last, total = res.last_seq, total + len(evs)
    wall = time.perf_counter() - t0
    return {"decision_p50_ms": pct(lat, 50), "decision_p99_ms": pct(lat, 99), "single_writer_events_per_s": total / wall}


async def bench_raw_decisions(url: str, decisions: int) -> dict[str, float]:
    """Floor for (a): plain nats-py, the same 1-5 message decisions as guarded atomic batches on a
    file stream of the same settings, on the same server (so the same `sync_interval`). R1 file
    streams fsync every atomic commit whatever that setting, so this is the disk's price, not ours."""
    import uuid

    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="RAW", subjects=["raw.>"], storage=api.StorageType.FILE,
                                         allow_atomic=True, deny_delete=True, deny_purge=True))
    rnd = random.Random(1)
    last, lat = 0, []
    for _ in range(decisions):
        k = rnd.randint(1, 5)
        body = b'{"type":"DeploymentRequested","model_key":"' + b"x" * 200 + b'"}'
        s = time.perf_counter()
        if k == 1:
            await nc.request("raw.a", body, headers={"Nats-Expected-Last-Sequence": str(last)}, timeout=5)
        else:
            b = uuid.uuid4().hex
            for j in range(1, k):
                h = {"Nats-Batch-Id": b, "Nats-Batch-Sequence": str(j)}
                if j == 1:
                    h["Nats-Expected-Last-Sequence"] = str(last)
                await nc.publish("raw.a", body, headers=h)
            await nc.request("raw.a", body, headers={"Nats-Batch-Id": b, "Nats-Batch-Sequence": str(k),
                                                      "Nats-Batch-Commit": "1"}, timeout=5)
        lat.append((time.perf_counter() - s) * 1000)
        last += k
    await nc.close()
    return {"raw_decision_p50_ms": pct(lat, 50), "raw_decision_p99_ms": pct(lat, 99)}


async def bench_group_commit(log: JetStreamEventLog, per_client: int,
                             clients: int = 16) -> tuple[dict[str, int | float], list[E.Event]]:
    gc: GroupCommitter[ClusterState] = await GroupCommitter(log, ClusterState()).start()
    payloads: list[E.Event] = []

    async def client(c: int) -> int:
        rnd = random.Random(100 + c)
        n = 0
        for i in range(per_client):
            k = rnd.randint(1, 5)

            def decide(state: ClusterState, k: int = k, c: int = c, i: int = i) -> list[E.Event]:
                ctx = DecisionContext(now=T0, actor=f"bench-{c}", command_id=f"gc-{c}-{i}")
                m = MODELS[(c * 7 + i) % len(MODELS)]
                cur = state.models[m].target_hot if m in state.models else 0
                evs: list[E.Event] = [ctx.event(E.DeploymentRequested, model_key=m, op=DeploymentOp.SCALE,
                                                replicas=cur + 1, target_hot=cur + 1)]
                evs += [ctx.event(E.PlacementRejected, model_key=m, needed_bytes=GB, free_bytes=0)
                        for _ in range(k - 1)]
                return evs

            res = await gc.submit(decide)
            payloads.extend(res.events)
            n += len(res.events)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    turns = gc.turns
    assert gc.state.anomaly_count == 0, gc.state.anomalies[:3]
    await gc.stop()
    return {"group_commit_events_per_s": sum(counts) / wall, "group_commit_turns": turns,
            "group_commit_decisions": clients * per_client}, payloads


async def bench_baseline(log: JetStreamEventLog, payloads: list[E.Event]) -> dict[str, float]:
    """The same events, each as an awaited guarded single publish (fresh ids, same bodies otherwise)."""
    import msgspec

    last = await log.last_seq()
    evs = [msgspec.structs.replace(e, event_id=f"base-{i}") for i, e in enumerate(payloads)]
    t0 = time.perf_counter()
    for e in evs:
        last = (await log.append([e], last)).last_seq
    return {"baseline_guarded_publish_per_s": len(evs) / (time.perf_counter() - t0)}


async def fill(log: JetStreamEventLog, events: list[E.Event]) -> None:
    await bulk_append(log, events, progress=lambda line: print(line, file=sys.stderr, flush=True))


async def raw_drain(url: str, last: int) -> float:
    """The baseline: plain nats-py, an ordered push consumer draining the stream by callback
    (the fastest of nats-py's own ways here; `next_msg()` is about 3x slower)."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    done = asyncio.Event()
    n = 0

    async def cb(msg: Msg) -> None:
        nonlocal n
        n += 1
        if n >= last:
            done.set()

    t0 = time.perf_counter()
    sub = await js.subscribe(EVENTS_ALL, stream=EVENTS_STREAM, ordered_consumer=True, cb=cb,
                             deliver_policy=api.DeliverPolicy.ALL,
                             pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
    await asyncio.wait_for(done.wait(), 120)
    wall = time.perf_counter() - t0
    await sub.unsubscribe()
    await nc.close()
    return n / wall


async def rebuild(url: str) -> tuple[float, ClusterState]:
    log = await JetStreamEventLog.open(url, ensure=False)
    t0 = time.perf_counter()
    state = await afold_batches(log.read_batches(), ClusterState())
    wall = time.perf_counter() - t0
    await log.close()
    return state.seq / wall, state


async def writes(args: argparse.Namespace, sync: str) -> dict[str, int | float]:
    """(a) and (b) on a server of their own whose `sync_interval` is `sync`."""
    out: dict[str, int | float] = {}
    with tempfile.TemporaryDirectory(prefix="ndif-bench-") as tmp, \
            EmbeddedNats(Path(tmp) / "a", sync_interval=sync) as srv:
        async with await JetStreamEventLog.open(srv.url) as log:
            print(f"(a) sync {sync}: single writer, decisions of 1-5 events with OCC ...", file=sys.stderr)
            out |= await bench_single_writer(log, args.decisions)
            out |= await bench_raw_decisions(srv.url, args.decisions)
            out["decision_over_raw"] = out["decision_p50_ms"] / out["raw_decision_p50_ms"]
            print(f"(b) sync {sync}: 16 concurrent commands, group commit vs guarded single publishes ...",
                  file=sys.stderr)
            gc, payloads = await bench_group_commit(log, args.per_client)
            out |= gc
            out |= await bench_baseline(log, payloads)
            out["append_ratio"] = out["group_commit_events_per_s"] / out["baseline_guarded_publish_per_s"]
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000, help="events in the rebuild stream (>= 200000)")
    ap.add_argument("--decisions", type=int, default=2000, help="decisions for the single-writer run")
    ap.add_argument("--per-client", type=int, default=150, help="decisions per client in the group-commit run")
    add_sync_option(ap)
    args = ap.parse_args()
    syncs = SYNC_CHOICES[args.sync]
    out: dict[str, int | float] = {}
    with tempfile.TemporaryDirectory(prefix="ndif-bench-") as tmp:
        lat = fsync_ms(Path(tmp))
        out["fsync_p50_ms"], out["fsync_p99_ms"] = pct(lat, 50), pct(lat, 99)
        print(f"fsync of a small append on {tmp}: p50 {out['fsync_p50_ms']:.2f} ms, p99 {out['fsync_p99_ms']:.2f} ms",
              file=sys.stderr)
    for sync in syncs:
        out |= {k + sync_suffix(sync): v for k, v in (await writes(args, sync)).items()}
    with tempfile.TemporaryDirectory(prefix="ndif-bench-") as tmp, \
            EmbeddedNats(Path(tmp) / "b", sync_interval=syncs[0]) as srv:
        async with await JetStreamEventLog.open(srv.url) as log:
            print(f"(c) rebuild: writing {args.events} lifecycle events ...", file=sys.stderr)
            await fill(log, lifecycle_events(args.events))
            last = await log.last_seq()
        # Paired design: each round runs the raw drain and our rebuild back to back, and the ratio is
        # the median of the per-round ratios. On 2 shared cores the machine's speed drifts by up to
        # 2x within a run; back-to-back runs see the same conditions, separate rounds do not.
        raws, folds, ratios = [], [], []
        for r in range(7):
            raws.append(await raw_drain(srv.url, last))
            per_s, state = await rebuild(srv.url)
            folds.append(per_s)
            ratios.append(per_s / raws[-1])
            print(f"  round {r + 1}: raw drain {raws[-1]:,.0f}/s, rebuild {per_s:,.0f}/s, ratio {ratios[-1]:.3f}",
                  file=sys.stderr)
        assert state.seq == last and state.anomaly_count == 0, (state.seq, last, state.anomalies[:3])
        out |= {"events": last, "rebuild_per_s": statistics.median(folds), "raw_drain_per_s": statistics.median(raws),
                "rebuild_ratio": statistics.median(ratios), "rebuild_ratio_min": min(ratios),
                "rebuild_ratio_max": max(ratios)}
    keys = ["events", "decision_p50_ms", "decision_p99_ms", "single_writer_events_per_s",
            "group_commit_events_per_s", "baseline_guarded_publish_per_s", "append_ratio", "rebuild_per_s",
            "raw_drain_per_s", "rebuild_ratio", "group_commit_turns", "group_commit_decisions",
            "raw_decision_p50_ms", "raw_decision_p99_ms", "rebuild_ratio_min", "rebuild_ratio_max"]
    keys = [k for k in keys if k in out] + sorted(set(out) - set(keys))
    print(json.dumps({k: round(out[k], 3) if isinstance(out[k], float) else out[k] for k in keys}))


if __name__ == "__main__":
    asyncio.run(main())
