"""Waiting in tests for something to become true: a condition, or the cluster state an admin reads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dataplane.ops.waiting import after_every_status, dispatcher_answering, until_state  # noqa: F401 - the tests' one place to wait from


async def until(cond: Callable[[], bool], timeout: float = 5.0, every: float = 0.01) -> None:
    """Return once `cond()` holds; TimeoutError after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(every)
