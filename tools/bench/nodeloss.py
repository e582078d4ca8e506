"""Benchmark of a node lost under traffic, on real multi-node Ray on loopback and a real nats-server.

`--nodes` Ray nodes (a head and workers, each a `ray start --block` process with its own raylet on
its own 127.0.0.x address, dataplane/ops/raynodes.py), one card each; the controller (in this
process, heartbeat grace `--grace`), an `ndif agent` per node and an `ndif dispatcher`
(dataplane/ops/multinode.py). A tiny GPT-2 at `--replicas` replicas (spread: one per node); a
request submitted every `--every` s; `--before` s in, a worker node holding a replica is SIGKILLed
(its whole `ray start` process group and its agent). The scenario is dataplane/ops/nodeloss.py's,
the one the long test runs (tests/faults/test_node_loss.py).

Figures, seconds from the kill unless said: `node_loss_recovery_s` kill -> the first request
COMPLETED on the replaced replica, made of `detect_s` (kill -> NodeLost arrives), `place_s` (->
ReplicaScheduled on another node), `load_s` (-> ReplicaLoaded), `first_result_s` (-> first request
completed on it); `max_gap_s` the longest time after the kill with no request completing anywhere;
`requests` submitted, `lost` (not ending COMPLETED), `run_twice` (more than one terminal status);
`rejoin_s` the node started again -> NodeJoined, `rejoin_replica_s` a scale-up by one -> its
replica Available (on `rejoined_replica_on`). The last line printed is one JSON object.

    python tools/bench/nodeloss.py [--nodes 3] [--replicas 2] [--grace 5] [--every 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controlplane.service.logs import configure

configure("ERROR")
logging.getLogger("ray").setLevel(logging.ERROR)

from controlplane.ops.nats_server import EmbeddedNats  # noqa: E402
from controlplane.store.eventstore import JetStreamEventLog  # noqa: E402
from dataplane.node.tiny_models import make_tiny_gpt2  # noqa: E402
from dataplane.ops.multinode import NodeSpec, running  # noqa: E402
from dataplane.ops.nodeloss import node_loss  # noqa: E402
from dataplane.ops.raynodes import RayNodes  # noqa: E402


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    specs = {f"node-{chr(ord('a') + i)}": NodeSpec(count=1, gib=16) for i in range(a.nodes)}
    with tempfile.TemporaryDirectory(prefix="nodeloss") as tmp:
        tiny = make_tiny_gpt2(Path(tmp) / "gpt2")
        srv = EmbeddedNats(Path(tmp) / "nats")
        srv.start()
        rn = RayNodes()
        try:
            t0 = time.monotonic()
            await asyncio.to_thread(rn.start, *specs)
            ray_start_s = time.monotonic() - t0
            lg = await JetStreamEventLog.open(srv.url, timeout=30)
            async with running(srv.url, lg, rn, specs, heartbeat_grace_s=a.grace) as st:
                run = await node_loss(st, str(tiny), replicas=a.replicas, heartbeat_grace_s=a.grace,
                                      head=next(iter(specs)), every_s=a.every, before_s=a.before,
                                      after_s=a.after)
        finally:
            rn.stop()
            srv.close()
    return {**run.figures(), "ray_nodes_start_s": round(ray_start_s, 1),
            "target_s": a.grace + 10, "within_target": (run.first_result_s or float("inf")) <= a.grace + 10}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--grace", type=float, default=5.0, help="heartbeat grace, seconds (the controller's default is 20)")
    p.add_argument("--every", type=float, default=0.25, help="seconds between requests")
    p.add_argument("--before", type=float, default=3.0, help="seconds of traffic before the kill")
    p.add_argument("--after", type=float, default=3.0, help="seconds of traffic after recovery")
    a = p.parse_args()
    if not 2 <= a.replicas < a.nodes <= 9:
        p.error("need 2 <= replicas < nodes <= 9 (a node with room for the lost replica)")
    print(json.dumps(asyncio.run(bench(a))))


if __name__ == "__main__":
    main()
