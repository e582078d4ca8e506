"""The fact gate with a fold of its own: for a log that no controller serves (a test, a replay
cluster, an operator who runs the gate apart). The controller runs the same gate over its own fold.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog

from controlplane.core.ports import Stored
from controlplane.core.projections import ClusterState
from controlplane.service.follow import catch_up, caught_up, follow_log
from controlplane.service.tasks import cancel_and_wait

logger = structlog.get_logger("ndif.factgate")


@contextlib.asynccontextmanager
async def fact_gate(log: Any) -> AsyncIterator[Any]:
    """Run the gate of `log` (a JetStream log: `log.fact_gate`) until the block ends; yields the gate."""
    state = await catch_up(log)

    def on_batch(batch: list[Stored]) -> None:
        for seq, item in batch:
            state.apply(seq, item)

    async def refold(new: ClusterState) -> None:
        state.become(new)

    gate = log.fact_gate(lambda: state, lambda: caught_up(log, lambda: state))
    tasks = [asyncio.create_task(follow_log(log, lambda: state.seq + 1, on_batch, logger=logger, refold=refold),
                                 name="gate-follow"),
             asyncio.create_task(gate.run(), name="fact-gate")]
    try:
        yield gate
    finally:
        await cancel_and_wait(tasks, owner="fact-gate")
