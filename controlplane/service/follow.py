"""The one "follow the log" loop every service runs (controller, node agent, dispatcher, dashboard).

Each starts from `catch_up` (the newest snapshot that matches the log plus the tail, whatever the
history's length) and folds the same events through the same reducers; what differs is what it
does after a batch. The loop resumes from the service's own fold (`next_seq()`), so an interrupted
feed (a server restart, a leader change) picks up exactly where the fold stopped: no gap, no
double apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from controlplane.core.ports import EventLog, Stored
from controlplane.core.projections import ClusterState
from controlplane.core.projections.base import Projection
from controlplane.service.logs import log_new_anomalies
from controlplane.store.rebuild import rebuild
from schemas.errors import InfrastructureError, LogRewound

RETRY_S = 0.5  # pause before following again after the feed broke


async def catch_up(log: EventLog) -> ClusterState:
    """A service's fold to start following from: the newest snapshot that matches the log (ignored,
    with a log line, when it does not), then every event after it up to the log's end now."""
    return await rebuild(log)


async def caught_up(log: EventLog, fold: Callable[[], Projection]) -> None:
    """Returns once the service's fold holds the log up to its end as of the call."""
    end = await log.last_seq()
    while fold().seq < end:
        await asyncio.sleep(0.01)


async def follow_log(log: EventLog, next_seq: Callable[[], int], on_batch: Callable[[list[Stored]], None],
                     *, logger: Any, fold: Callable[[], Projection] | None = None, retry_s: float = RETRY_S,
                     refold: Callable[[ClusterState], Awaitable[None]] | None = None) -> None:
    """Feed every batch of events from `next_seq()` on to `on_batch`, forever, across interruptions.

    `on_batch` is synchronous (it folds and schedules work; it never awaits), so a batch is applied
    whole before the next one is read. Cancellation stops the loop; any other error is logged
    (`follow_interrupted` for the infrastructure, `follow_failed` with a traceback otherwise) and
    the loop follows again from the fold's position after `retry_s`.

    With `fold` (the service's projection), what the fold found in each batch (anomalies, unreadable
    messages; the fold itself never logs) is logged once here: the history a service rebuilt from
    before following is not logged again on a restart.

    A log that ends before what the service folded (LogRewound: the store lost its tail, or was
    restored) is folded again from the start and handed to `refold`, which takes it in place of the
    service's fold and acts on what the log holds now; without `refold` the error is raised.
    """
    rewound = False
    while True:
        try:
            if rewound:  # folded again inside the loop: a failure here is retried like the feed's
                await refold(await catch_up(log))  # type: ignore[misc]
                rewound = False
            async for batch in log.follow_batches(next_seq()):
                mark = next_seq() - 1
                on_batch(batch)
                if fold is not None:
                    log_new_anomalies(logger, fold(), mark)
        except asyncio.CancelledError:
            raise
        except LogRewound as exc:
            logger.error("log_rewound", folded_seq=exc.folded_seq, last_seq=exc.last_seq, error=str(exc))
            if refold is None:
                raise
            rewound = True
        except InfrastructureError as exc:
            logger.warning("follow_interrupted", error=str(exc))
            await asyncio.sleep(retry_s)
        except Exception as exc:
            logger.exception("follow_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(retry_s)
