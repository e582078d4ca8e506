"""Snapshots of a fold (`SnapshotStore`, controlplane/core/ports.py), kept by name in the object store bucket.

Written with nats-py's object store (the controller); read and listed by direct gets
(controlplane/store/direct.py), which every role that folds may do: agents and the dashboard may
create no consumer, and nats-py's own object reads need one.
"""

from __future__ import annotations

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from controlplane.core.projections.snapshot import MAX_SNAPSHOT_BYTES
from controlplane.store.direct import object_names, read_object
from schemas.errors import NotFound
from schemas.subjects import SNAPSHOTS_BUCKET

WRITE_TIMEOUT_S = 30.0  # a snapshot is stored in the background: a busy server may take its time


async def save_snapshot(nc: NatsClient, name: str, data: bytes) -> None:
    obs = await nc.jetstream(timeout=WRITE_TIMEOUT_S).object_store(SNAPSHOTS_BUCKET)
    await obs.put(name, data)


async def load_snapshot(nc: NatsClient, name: str, *, timeout: float) -> bytes | None:
    try:
        return await read_object(nc, SNAPSHOTS_BUCKET, name, timeout=timeout, max_bytes=MAX_SNAPSHOT_BYTES)
    except NotFound:
        return None


async def snapshot_names(nc: NatsClient, *, timeout: float) -> list[str]:
    return await object_names(nc, SNAPSHOTS_BUCKET, timeout=timeout)


async def delete_snapshot(js: JetStreamContext, name: str) -> None:
    obs = await js.object_store(SNAPSHOTS_BUCKET)
    try:
        await obs.delete(name)
    except nats.js.errors.NotFoundError:
        return
