"""What the benchmarks share: percentiles, and the typed field sets their synthetic events are built from.

Imported by the scripts beside it (`python tools/bench/<name>.py` puts this directory on sys.path).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict


async def tiny_model_stack(tmp: Path, nats_dir: str, ray_nodes: int, num_cpus: int) -> tuple[Any, str, str, str]:
    """A nats-server of its own under `tmp / nats_dir`, a local Ray of `ray_nodes` nodes, and a tiny
    GPT-2 checkpoint: (the server, its URL, the checkpoint, its model key). Imported late: the
    benchmarks without Ray need none of it."""
    from controlplane.ops.nats_server import EmbeddedNats
    from dataplane.node.tiny_models import make_tiny_gpt2
    from dataplane.runtime import ray_adapter
    from schemas.keys import canonical_model_key

    srv = EmbeddedNats(tmp / nats_dir)
    await srv.astart()
    ray_adapter.start_local(ray_nodes, num_cpus=num_cpus)
    ckpt = str(make_tiny_gpt2(tmp / "tiny"))
    return srv, srv.url, ckpt, canonical_model_key(ckpt)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


class Envelope(TypedDict):
    """The envelope fields of every event (`E.Event`), passed as `**env`."""

    event_id: str
    ts: datetime
    actor: str


class ReplicaRef(TypedDict):
    """The fields naming a replica (`E.ReplicaEvent`), passed as `**rep`."""

    model_key: str
    replica_id: int
    node_id: str
