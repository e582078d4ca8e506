"""Snapshots of a fold (`SnapshotStore`, controlplane/core/ports.py), kept by name in the object store bucket."""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext

from schemas.subjects import SNAPSHOTS_BUCKET


async def save_snapshot(js: JetStreamContext, name: str, data: bytes) -> None:
    obs = await js.object_store(SNAPSHOTS_BUCKET)
    await obs.put(name, data)


async def load_snapshot(js: JetStreamContext, name: str) -> bytes | None:
    obs = await js.object_store(SNAPSHOTS_BUCKET)
    try:
        res = await obs.get(name)
    except nats.js.errors.ObjectNotFoundError:
        return None
    return bytes(res.data) if res.data is not None else None
