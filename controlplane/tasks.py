"""Stopping background tasks without ever hanging (used by the controller, agent and dispatcher)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import structlog


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, owner: str, timeout: float = 10.0) -> None:
    """Cancel tasks and wait for them, at most `timeout` seconds: a stop never hangs.

    A task still running after that is named in a warning with where it is stuck (the usual cause:
    an `await` that swallows cancellation, or a blocking call in the loop).
    """
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if not pending:
        return
    _, stuck = await asyncio.wait(pending, timeout=timeout)
    for t in stuck:
        frames = t.get_stack(limit=3)
        where = " <- ".join(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}" for f in frames)
        structlog.get_logger("ndif.tasks").warning("task_not_stopping", owner=owner, task=t.get_name(), at=where,
                                                   seconds=timeout)
