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
        structlog.get_logger("ndif.tasks").warning("task_not_stopping", owner=owner, task=t.get_name(),
                                                   at=awaiting(t), seconds=timeout)


def awaiting(task: asyncio.Task[Any], limit: int = 12) -> str:
    """Where a suspended task waits, outermost first: `file:line` of each coroutine it awaits through.

    (`Task.get_stack()` of a suspended task shows only its own coroutine's frame, not what that awaits.)
    """
    out: list[str] = []
    aw: Any = task.get_coro()
    while aw is not None and len(out) < limit:
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None) or getattr(aw, "gi_frame", None)
        if frame is None:
            out.append(type(aw).__name__)  # a future, or a finished coroutine
            break
        out.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        aw = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None) or getattr(aw, "gi_yieldfrom", None)
    return " -> ".join(out)
