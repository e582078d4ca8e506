"""The dispatcher's background work: one set of tasks, so stopping cancels every one of them.

Every part of the dispatcher spawns through the same `Background`; once it is stopped nothing new
starts (a request not finished is then redelivered to the next dispatcher).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopped = False

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a tracked task (closed unrun once stopping)."""
        if self.stopped:
            coro.close()  # stopping: nothing new starts (a request not finished is redelivered)
            return
        self.track(asyncio.create_task(coro))

    def track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """Keep `task` until it ends, so stopping can cancel it."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
