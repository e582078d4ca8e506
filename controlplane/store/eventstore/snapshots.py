"""Snapshots of a fold (`SnapshotStore`, controlplane/core/ports.py), kept by name in the object store bucket.

Written with nats-py's object store (the controller); read and listed by direct gets
(controlplane/store/direct.py), which every role that folds may do: agents and the dashboard may
create no consumer, and nats-py's own object reads need one.
"""

from __future__ import annotations

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import api
from nats.js.object_store import ObjectStore

from controlplane.core.projections.snapshot import MAX_SNAPSHOT_BYTES
from controlplane.store.direct import object_names, read_object
from schemas.errors import NotFound
from schemas.subjects import SNAPSHOTS_BUCKET

WRITE_TIMEOUT_S = 30.0  # a snapshot is stored in the background: a busy server may take its time
# Chunks of 512 KiB (nats-py's default is 128): a compressed fold of a few hundred KB is one message,
# so a write is three round trips, and a chunk stays under a server's default 1 MiB payload.
CHUNK_BYTES = 512 * 1024


async def open_store(nc: NatsClient) -> ObjectStore:
    """The snapshot bucket, for writes (looked up once per connection: it costs a stream info)."""
    return await nc.jetstream(timeout=WRITE_TIMEOUT_S).object_store(SNAPSHOTS_BUCKET)


async def save_snapshot(obs: ObjectStore, name: str, data: bytes) -> None:
    await obs.put(name, data, meta=api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=CHUNK_BYTES)))


async def load_snapshot(nc: NatsClient, name: str, *, timeout: float, api: str) -> bytes | None:
    try:
        return await read_object(nc, SNAPSHOTS_BUCKET, name, timeout=timeout, max_bytes=MAX_SNAPSHOT_BYTES, api=api)
    except NotFound:
        return None


async def snapshot_names(nc: NatsClient, *, timeout: float, api: str) -> list[str]:
    return await object_names(nc, SNAPSHOTS_BUCKET, timeout=timeout, api=api)


async def delete_snapshot(obs: ObjectStore, name: str) -> None:
    try:
        await obs.delete(name)
    except nats.js.errors.NotFoundError:
        return
