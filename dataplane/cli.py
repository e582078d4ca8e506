"""`ndif`: the admin commands (controlplane/cli.py) plus the data-plane ones.

    ndif up [--port 4222] [--store DIR] [--gpus N --gpu-memory-gb G] [--cpu-cache-gb C]
        embedded NATS + local Ray + controller + one node agent, until Ctrl-C
    ndif agent --nats URL [--ray-address ADDR] [--node-id ID] [--gpus N --gpu-memory-gb G]
        one node agent (run one per Ray node)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from controlplane.cli import main as admin_main
from schemas import errors as errs

GiB = 2**30


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-id", help="this node's id in the log (default: the hostname)")
    p.add_argument("--gpus", type=int, help="declare N GPUs (CPU-only machines, tests); default: the real CUDA devices")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of each declared GPU (default 80)")
    p.add_argument("--cpu-cache-gb", type=float, help="CPU memory for WARM replicas (default: half the RAM)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to wait for the dispatcher's drain report before unloading anyway")
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat interval in seconds")


def add_dataplane_commands(sub: Any) -> None:
    p = sub.add_parser("up", help="embedded NATS + local Ray + controller + agent on this machine")
    p.add_argument("--port", type=int, default=4222, help="NATS port (default 4222)")
    p.add_argument("--store", type=Path, default=Path(os.environ.get("NDIF_HOME", Path.home() / ".ndif")) / "nats",
                   help="JetStream store directory (kept across runs)")
    _node_args(p)
    p = sub.add_parser("agent", help="run the node agent of this Ray node")
    p.add_argument("--nats", default=os.environ.get("NDIF_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="Ray cluster to join (default: auto, the cluster of this machine)")
    _node_args(p)


def _agent_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    from dataplane.agent import declared_gpus

    kw: dict[str, Any] = {"node_id": a.node_id, "drain_timeout_s": a.drain_timeout, "heartbeat_s": a.heartbeat}
    if a.gpus is not None:
        kw["gpus"] = declared_gpus(a.gpus, int(a.gpu_memory_gb * 1e9))
    if a.cpu_cache_gb is not None:
        kw["cpu_cache_bytes"] = int(a.cpu_cache_gb * 1e9)
    return kw


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _agent(a: argparse.Namespace) -> int:
    import ray

    from dataplane.agent import NodeAgent
    from dataplane.model_actor import NAMESPACE

    ray.init(address=a.ray_address, namespace=NAMESPACE, log_to_driver=False)
    async with NodeAgent(a.nats, **_agent_kwargs(a)):
        await _until_signal()
    return 0


async def _up(a: argparse.Namespace) -> int:
    import ray

    from controlplane.controller import Controller
    from controlplane.eventstore import JetStreamEventLog
    from controlplane.nats_server import EmbeddedNats
    from dataplane.agent import NodeAgent, detect_gpus
    from dataplane.model_actor import NAMESPACE

    srv = EmbeddedNats(a.store, port=a.port)
    try:
        await srv.astart()
    except Exception as exc:  # noqa: BLE001 - port taken, binary missing: one clear line
        raise errs.InfrastructureError(f"cannot start nats-server on port {a.port} ({exc}); "
                                       "is another `ndif up` running? try --port") from None
    url = srv.url
    try:
        log = await JetStreamEventLog.open(url)
        await log.close()
        kw = _agent_kwargs(a)
        gpus = kw.get("gpus") or detect_gpus()
        print(f"ndif up: NATS {url} (store {a.store}); starting Ray with {len(gpus)} GPU(s)...", flush=True)
        ray.init(num_gpus=len(gpus), namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        async with Controller(url), NodeAgent(url, **{**kw, "gpus": gpus}) as agent:
            print(f"ndif up: controller and agent {agent.node_id} running. In another shell:\n"
                  f"  export NDIF_NATS_URL={url}\n"
                  "  python tools/tiny_models.py /tmp/ndif-models\n"
                  "  ndif deploy /tmp/ndif-models/tiny-gpt2 --replicas 2 --wait\n"
                  "  ndif status\n"
                  "Ctrl-C stops everything.", flush=True)
            await _until_signal()
        print("ndif up: stopping", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        srv.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    return admin_main(argv, extra=add_dataplane_commands, runners={"up": _up, "agent": _agent})


if __name__ == "__main__":
    sys.exit(main())
