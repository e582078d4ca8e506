"""End-to-end demo: embedded NATS + local Ray + controller + node agent + real tiny models.

    python tools/demo.py

It starts its own `nats-server` (JetStream, free port, temp store) and a local Ray with 2 declared
GPUs (CPU machines load the models on the CPU), runs the controller and one node agent in this
process, makes two tiny real checkpoints (GPT-2 and Llama, random weights, `save_pretrained`), and
then drives the cluster with the real `ndif` CLI: deploy, a request on each replica, evict to WARM,
scale back (the same replica id returns from the CPU cache), an actor killed and restarted by the
controller's policy, history, replay, and evict --all --cold. Every step is an event in the log.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controlplane.service.logs import configure  # noqa: E402

configure("WARNING")

from controlplane.store.admin import AdminClient  # noqa: E402
from dataplane.node.agent import declared_gpus  # noqa: E402
from dataplane.node.tiny_models import make_tiny_gpt2, make_tiny_llama  # noqa: E402
from dataplane.ops.demo import run_cli, say  # noqa: E402
from dataplane.ops.local import LocalCluster  # noqa: E402
from dataplane.replica.actor import NAMESPACE  # noqa: E402
from dataplane.runtime.ray_adapter import get_actor, kill_actor, list_replica_actors  # noqa: E402
from schemas.keys import canonical_model_key  # noqa: E402
from schemas.status import ReplicaState  # noqa: E402
from schemas.units import GiB  # noqa: E402


async def settle(admin: AdminClient, timeout: float = 120) -> None:
    moving = {"LoadRequested", "Loading", "Draining", "UnloadRequested", "Restarting"}
    async with asyncio.timeout(timeout):
        while any(str(r.state) in moving for r in (await admin.state()).replicas.values()):
            await asyncio.sleep(0.1)


async def main() -> None:
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="ndif-demo-"))
    say("Starting nats-server (JetStream, temp store) and a local Ray with 2 declared GPUs")
    cluster = LocalCluster(store=tmp / "nats", gpus=declared_gpus(2, 80 * GiB), node_id="node-1", dispatcher=False,
                           controller={"policy_interval_s": 0.2},
                           agent={"cpu_cache_bytes": 20 * GiB, "drain_timeout_s": 0.5, "heartbeat_s": 1.0,
                                  "health_interval_s": 0.5})
    url = cluster.start_nats()
    await cluster.ensure_log()  # creates the streams and buckets
    print(f"  NATS {url}; Ray namespace '{NAMESPACE}'", flush=True)

    say("Making two tiny real checkpoints (random weights, save_pretrained)")
    gpt2 = str(make_tiny_gpt2(tmp / "models" / "tiny-gpt2"))
    llama = str(make_tiny_llama(tmp / "models" / "tiny-llama"))
    print(f"  {gpt2}\n  {llama}", flush=True)
    mk = canonical_model_key(gpt2)

    try:
        async with cluster, await AdminClient.open(url) as admin:
            say("Deploy 2 replicas of tiny-gpt2 (the controller registers it: size measured on the meta device)")
            await run_cli(url, "deploy", gpt2, "--replicas", "2", "--wait")
            await run_cli(url, "deploy", llama, "--replicas", "1", "--wait")

            say("Each replica is a detached Ray actor named ModelActor:<model_key>:<replica_id>; same input, "
                "same output")
            for rid in (0, 1):
                actor = get_actor(mk, rid)
                assert actor is not None, f"replica {rid} has no actor after deploy --wait"
                out = await actor.__call__.remote({"op": "generate", "prompt": "hello", "max_new_tokens": 5})
                print(f"  replica {rid}: {out['output_ids'][0]}", flush=True)

            say("Evict replica 1: HOT -> WARM (weights kept in the actor's CPU memory)")
            await run_cli(url, "evict", gpt2, "--replica-id", "1")
            await settle(admin)
            await run_cli(url, "status")
            warm_seq = (await admin.state()).seq

            say("Scale back to 2: placement reuses the WARM copy, so replica 1 returns with its id")
            await run_cli(url, "scale", gpt2, "--replicas", "2", "--wait")

            say("Kill replica 0's actor behind the agent's back: ReplicaFailed, then the controller restarts it")
            kill_actor(get_actor(mk, 0))
            async with asyncio.timeout(120):
                while (r := (await admin.state()).replicas[(mk, 0)]).restarts < 1 or r.state != ReplicaState.AVAILABLE:
                    await asyncio.sleep(0.2)
            print("  replica 0 is Available again (restarts: 1)", flush=True)

            say("Every step of replica 1, with the command and actor that caused it")
            await run_cli(url, "history", gpt2, "--replica-id", "1")

            say(f"Replay: the cluster as it was at seq {warm_seq} (replica 1 WARM)")
            await run_cli(url, "replay", "--until", str(warm_seq))

            say("Evict everything to COLD: the actors are gone, the log keeps the story")
            await run_cli(url, "evict", "--all", "--cold")
            await settle(admin)
            print(f"  actors left: {len(list_replica_actors())}", flush=True)
            await run_cli(url, "events", "--since", "1")
    finally:
        await cluster.stop()
    say(f"Done in {time.perf_counter() - t_start:.0f}s. To keep a cluster running: `ndif up`, then in another "
        "shell `ndif deploy DIR --replicas 2 --wait`, `ndif status --watch`, `ndif history DIR`, "
        "`ndif replay --until SEQ`, `nats stream view NDIF_EVENTS` (docs/cli.md).")


if __name__ == "__main__":
    asyncio.run(main())
