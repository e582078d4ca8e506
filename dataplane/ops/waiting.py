"""Waiting for the cluster, in tests and benchmarks: a cluster state an admin reads, a dispatcher
answering."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas.subjects import DISPATCHER_STATE


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
