"""Waiting for the cluster, in tests and benchmarks: a cluster state an admin reads, a dispatcher
answering, every status delivered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas.requests import StatusUpdate, encoder
from schemas.status import RequestStatus
from schemas.subjects import DISPATCHER_STATE, REQUEST_STATUS_BUCKET, REQUESTS_STREAM


async def until_state(admin: AdminClient, pred: Callable[[ClusterState], bool],
                      timeout: float = 60.0) -> ClusterState:
    """The first cluster state for which `pred` holds: the log folded once, then followed.

    The state only changes with an event, so `pred` is asked again after each batch the log
    delivers (never on a timer, never by folding the whole log again).
    """
    async with asyncio.timeout(timeout):
        state = await admin.state()
        if pred(state):
            return state
        follow: Any = admin.log.follow_batches(state.seq + 1)  # a generator (typed as its iterator): closed on the way out
        async with contextlib.aclosing(follow) as feed:
            async for batch in feed:
                for seq, item in batch:
                    state.apply(seq, item)
                if pred(state):
                    return state
    raise AssertionError("the log's feed ended")  # a follow never ends by itself




async def dispatcher_answering(log: JetStreamEventLog, name: str | None = None, timeout: float = 60.0) -> None:
    """Return once a dispatcher (named `name`, if given) answers on its state subject: it is started
    and takes the requests published from now on."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                msg = await log.nc.request(DISPATCHER_STATE, b"", timeout=0.5)
                if name is None or json.loads(msg.data)["dispatcher"] == name:
                    return
            except Exception:  # noqa: BLE001 - no dispatcher yet (no responders, or a timeout)
                await asyncio.sleep(0.1)


async def after_every_status(log: JetStreamEventLog, seen: set[str], timeout: float = 30.0) -> None:
    """Return once every status a dispatcher can still keep has been delivered.

    No request is held any more: the request stream is a work queue, empty once every request was
    acknowledged, and a dispatcher acknowledges only after keeping the terminal status. Then a
    marker status is put: the bucket delivers it after everything kept before it, so once the
    caller's subscription has recorded its request id (in `seen`), a late duplicate would have been
    counted. The marker is QUEUED (not terminal) under a fresh id.
    """
    async with asyncio.timeout(timeout):
        while (await log.js.stream_info(REQUESTS_STREAM)).state.messages:
            await asyncio.sleep(0.05)
        marker = f"marker-{uuid.uuid4().hex[:12]}"
        kv = await log.js.key_value(REQUEST_STATUS_BUCKET)
        await kv.put(marker, encoder.encode(StatusUpdate(request_id=marker, status=RequestStatus.QUEUED,
                                                         ts=datetime.now(UTC))))
        while marker not in seen:
            await asyncio.sleep(0.01)
