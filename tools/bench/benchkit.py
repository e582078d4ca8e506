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


async def bulk_append(log: Any, events: list[Any], *, progress: Any = None) -> int:
    """Append a prepared history (the controller's events and agents' observed facts mixed, in order)
    as fast as the server takes it: a benchmark's setup, not what it measures. Returns the log's last seq.

    The product appends each observed fact alone, through NDIF_FACTS, and returns once the log has
    sourced it (decision 48): 200,000 generated facts that way would take minutes, and a guarded batch
    may hold none. So for the time of the load the log is put back the way a version before the facts
    stream made it (every event subject its own, atomic batches of any events; NDIF_FACTS taken away,
    which must hold no fact the log has not sourced: nothing but this appends during a setup), filled
    in atomic batches of E.MAX_BATCH, and migrated again by `ensure()`, as any such log is
    (tests/integration/test_eventstore_nats.py: a log made before the facts stream)."""
    import dataclasses
    import time

    import nats.js.errors

    from controlplane.store.eventstore import appends, topology
    from schemas import events as E
    from schemas.subjects import EVENTS_ALL, FACTS_STREAM

    js = log.js
    try:
        # The facts stream made again numbers from 1, and a log resumes a source after the last of
        # its messages it holds: a fact appended the product's way before this would make the log
        # pass over as many new facts. So a bulk load comes before any.
        if (await js.stream_info(FACTS_STREAM)).state.last_seq:
            raise RuntimeError(f"bulk_append: {FACTS_STREAM} has taken facts already; bulk-load before any "
                               "fact is appended the product's way")
        await js.delete_stream(FACTS_STREAM)
    except nats.js.errors.NotFoundError:
        pass
    await js.update_stream(dataclasses.replace(topology.events_config(1), subjects=[EVENTS_ALL], sources=None))
    t0, done = time.perf_counter(), 0
    for i in range(0, len(events), E.MAX_BATCH):
        batch = events[i:i + E.MAX_BATCH]
        ack = await appends._publish_batch(log.nc, batch, None, 30.0)
        if ack.error is not None:
            raise RuntimeError(f"bulk append refused at event {i}: {ack.error.description}")
        done += len(batch)
        if progress is not None and (done % 50_000 < E.MAX_BATCH or done == len(events)):
            progress(f"  appended {done:>9,} / {len(events):,} events ({done / (time.perf_counter() - t0):,.0f}/s)")
    # Adding the source back makes the server scan the log for where it left off (about 70 us an
    # event here: a minute at a million), more than the API's usual wait. (Keeping the source while
    # NDIF_FACTS is made again leaves it stalled: no later fact reached the log in a trial.)
    await topology.ensure(log.nc.jetstream(timeout=300), replicas=1, may_create=True)
    return int(await log.last_seq())


async def append_in_order(log: Any, events: list[Any]) -> None:
    """Append a mixed history the product's way, in order: each run of the controller's events as
    guard-free atomic batches, each observed fact alone (through NDIF_FACTS, returning once the log
    has it, as an agent's append does). For what follows a live cluster; `bulk_append` for a setup."""
    from schemas import events as E
    from schemas.events import event_subject
    from schemas.subjects import is_fact_subject

    run: list[Any] = []
    for ev in [*events, None]:
        if ev is not None and not is_fact_subject(event_subject(ev)):
            run.append(ev)
            if len(run) < E.MAX_BATCH:
                continue
        if run:
            await log.append(run, None)
            run = []
        if ev is not None and is_fact_subject(event_subject(ev)):
            await log.append([ev], None)
