"""Waiting in tests for something to become true: a condition, or the cluster state an admin reads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from controlplane.core.projections import ClusterState
from controlplane.store.admin import AdminClient


async def until(cond: Callable[[], bool], timeout: float = 5.0, every: float = 0.01) -> None:
    """Return once `cond()` holds; TimeoutError after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(every)


async def until_state(admin: AdminClient, pred: Callable[[ClusterState], bool], timeout: float = 60.0,
                      every: float = 0.1) -> ClusterState:
    """The first cluster state (as `admin.state()` folds it) for which `pred` holds."""
    async with asyncio.timeout(timeout):
        while True:
            st = await admin.state()
            if pred(st):
                return st
            await asyncio.sleep(every)
