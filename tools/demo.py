"""End-to-end demo of the event log (issue 3 stage): embedded NATS, decisions appended with OCC and
group commit, agents' observations, the folded cluster view, a replay to a past point, and a
restart of the server on the same store.

    python tools/demo.py            # prints each step and the commands to look further
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog

from controlplane.committer import GroupCommitter, afold_batches
from controlplane.context import DecisionContext, observed, utcnow
from controlplane.eventstore import JetStreamEventLog
from controlplane.nats_server import EmbeddedNats
from controlplane.projections import ClusterState, decode_snapshot, encode_snapshot, replay
from controlplane.render import render_status
from schemas import events as E
from schemas.keys import canonical_model_key
from schemas.status import DeploymentOp, EvictionReason, Level

GiB = 2**30
NODE = "gpu-node-1.local"


def step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def schedule(model: str, rid: int, gpus: tuple[int, ...], size: int, cmd: str, source: Level = Level.COLD):
    """A tiny stand-in for placement (the controller issue brings the real one)."""

    def decide(state: ClusterState) -> list[E.Event]:
        ctx = DecisionContext(now=utcnow(), actor="demo-controller", command_id=cmd)
        m = state.models.get(model)
        target = (m.target_hot if m else 0) + 1
        return [ctx.event(E.DeploymentRequested, model_key=model, op=DeploymentOp.SCALE, replicas=target,
                          target_hot=target),
                ctx.event(E.ReplicaScheduled, model_key=model, replica_id=rid, node_id=NODE, gpu_indices=gpus,
                          bytes_per_gpu=size, source=source)]

    return decide


async def agent(log: JetStreamEventLog, gc: GroupCommitter[ClusterState], *events: E.Event) -> None:
    """An agent's observations, appended with OCC like every writer's."""
    for ev in events:
        while True:
            try:
                res = await log.append([ev], gc.state.seq)
                break
            except Exception:  # noqa: BLE001 - a conflict: catch up and try again
                await gc.catch_up()
        await gc.catch_up(res.last_seq)


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    gpt2 = canonical_model_key("openai-community/gpt2")
    llama = canonical_model_key("meta-llama/Llama-3.1-8B")
    with tempfile.TemporaryDirectory(prefix="ndif-demo-") as tmp:
        srv = EmbeddedNats(Path(tmp) / "nats")
        step("starting an embedded nats-server with JetStream")
        srv.start()
        print(f"    {srv.url}  store: {srv.store_dir}")
        async with await JetStreamEventLog.open(srv.url) as log:
            gc: GroupCommitter[ClusterState] = await GroupCommitter(log, ClusterState()).start()
            step("an agent joins: 1 node, 2 x 80 GiB GPUs, 64 GiB CPU cache")
            await agent(log, gc, observed(E.NodeJoined, actor=f"agent:{NODE}", node_id=NODE, cpu_cache_bytes=64 * GiB,
                                          gpus=tuple(E.GpuInfo(index=i, memory_bytes=80 * GiB, name="H100")
                                                     for i in range(2))))
            step("3 deploy decisions at once, group-committed as one atomic batch (one OCC expectation)")
            turns = gc.turns
            results = await asyncio.gather(
                gc.submit(schedule(gpt2, 0, (0,), GiB, "demo-deploy-gpt2-0")),
                gc.submit(schedule(gpt2, 1, (1,), GiB, "demo-deploy-gpt2-1")),
                gc.submit(schedule(llama, 0, (0, 1), 9 * GiB, "demo-deploy-llama-0")),
            )
            for r in results:
                print(f"    seq {r.first_seq}..{r.last_seq}: {', '.join(type(e).__name__ for e in r.events)}")
            print(f"    loop turns used: {gc.turns - turns}")
            step("the agent loads them (observed events)")
            for m, rid in ((gpt2, 0), (gpt2, 1), (llama, 0)):
                rep = {"model_key": m, "replica_id": rid, "node_id": NODE}
                await agent(log, gc, observed(E.ReplicaLoading, actor=f"agent:{NODE}", **rep),
                            observed(E.ReplicaLoaded, actor=f"agent:{NODE}", load_seconds=1.5, **rep))
            loaded_seq = gc.state.seq
            step("evict gpt2 replica 1 to WARM, then the agent caches it on CPU")
            await gc.submit(lambda s: [DecisionContext(now=utcnow(), actor="demo-cli", command_id="demo-evict").event(
                E.ReplicaEvictionRequested, model_key=gpt2, replica_id=1, node_id=NODE, reason=EvictionReason.ADMIN,
                target=Level.WARM)])
            await agent(log, gc, observed(E.ReplicaCached, actor=f"agent:{NODE}", model_key=gpt2, replica_id=1,
                                          node_id=NODE, cpu_bytes=GiB))
            print(render_status(gc.state))
            step(f"replay: the cluster as it was at seq {loaded_seq} (before the eviction)")
            past = replay([p async for p in log.read(stop_seq=loaded_seq)], strict=True)
            print(render_status(past))
            step("snapshot to the Object Store, then snapshot + tail == full fold")
            await log.save_snapshot("demo", encode_snapshot(past))
            snap = decode_snapshot(await log.load_snapshot("demo"))
            snap_seq = snap.seq
            resumed = await afold_batches(log.read_batches(snap_seq + 1), snap)  # folds into `snap`
            print(f"    snapshot at seq {snap_seq} + tail -> seq {resumed.seq}; equal to the full fold: "
                  f"{resumed == gc.state}")
            await gc.stop()
        step("kill -9 the server, restart it on the same store, fold again")
        srv.kill()
        srv.start()
        async with await JetStreamEventLog.open(srv.url) as log:
            again = await afold_batches(log.read_batches(), ClusterState())
            print(f"    {again.seq} events back; same state as before the crash: {again == gc.state}")
        step("look further with the nats CLI while a server runs (subjects and headers in docs/architecture.md):")
        print("    nats stream view NDIF_EVENTS       # JSON bodies, Nats-Msg-Id / Ndif-Event / Ndif-Schema headers")
        print("    nats stream info NDIF_EVENTS       # deny_delete, deny_purge, allow_atomic")
        srv.close()


if __name__ == "__main__":
    asyncio.run(main())
