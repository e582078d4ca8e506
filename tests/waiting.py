"""Waiting in tests for something to become true: a condition, or the cluster state an admin reads."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from controlplane.store.eventstore import JetStreamEventLog
from dataplane.ops.waiting import dispatcher_answering, until_state  # noqa: F401 - the tests' one place to wait from
from schemas.requests import StatusUpdate, encoder
from schemas.status import RequestStatus
from schemas.subjects import REQUEST_STATUS_BUCKET, REQUESTS_STREAM


async def until(cond: Callable[[], bool], timeout: float = 5.0, every: float = 0.01) -> None:
    """Return once `cond()` holds; TimeoutError after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(every)


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
